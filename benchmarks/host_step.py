"""Host (Python) work per decode step of the rollout engine, device work stubbed out, on this CPU.

    python benchmarks/host_step.py --batch 1,32,128,256 [--profile]

On the GPU the engine queues step t, then schedules and builds step t+1 while step t runs (async scheduling);
when that host work takes longer than the GPU step, it sets the decode rate. This measures it on the CPU:
the real scheduler, sampling-tensor building, sampler op launches (tiny vocab) and flush (append, stop checks),
with the model forward replaced by the CUDA path's host part only: `decode_inputs` (ids, positions, slots,
block tables as lists) and `flat_inputs` (the staging layout of `DecodeGraphs`) plus the upload into a staging
tensor, then a preallocated logits tensor. Time per step, median over steps of steady decode.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from moeloop.model.factory import build_model
from moeloop.rollout import Engine, SamplingParams
from moeloop.rollout.cuda_graphs import batch_ladder, flat_inputs
from moeloop.rollout.runner import decode_inputs
from sized_engine import sized_engine


def stub_forward(engine: Engine) -> None:
    """Replace the forward by its CUDA-path host work (decode batches) and a logits tensor."""
    runner = engine.runner
    V, bs = runner.vocab_size, engine.cache.block_size
    sizes = batch_ladder(engine.cfg.max_num_seqs)
    staging = torch.zeros(sizes[-1] * (4 + runner.max_blocks_per_seq) + 2 * sizes[-1], dtype=torch.int64)
    logits = torch.zeros(sizes[-1], V)
    eager = runner._eager_logits

    def host_only(batch, patch, rows):
        if any(n != 1 for n in batch.num_new_tokens):
            return eager(batch, patch, rows)  # prefill: the real forward
        size = next(s for s in sizes if s >= len(batch))
        ids, pos, slots, lens, tables = decode_inputs(batch, bs)
        host_patch = None if patch is None else (patch[0], patch[1], None)
        flat, _ = flat_inputs(size, runner.max_blocks_per_seq, engine.cache.scratch_block, bs, ids, pos, slots, lens,
                              tables, host_patch)
        staging[:len(flat)].copy_(torch.frombuffer(flat, dtype=torch.int64))
        return logits[:len(rows)]

    runner._eager_logits = host_only


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps of the largest batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model("qwen3_moe", "tiny", seed=0).eval()
    P, N = args.prompt_len, args.new_tokens
    print(f"host work per decode step, device work stubbed; torch {torch.__version__}, 1 thread; "
          f"prompt {P}, up to {N} new tokens, top-k 50 sampling with logprobs")
    for B in [int(b) for b in args.batch.split(",")]:
        engine = sized_engine(model, B, P, N, async_scheduling="on")
        stub_forward(engine)
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=N, top_k=50, seed=1, logprobs=True)  # one object, as `generate` passes it
        for p in torch.randint(3, model.cfg.vocab_size, (B, P), generator=g).tolist():
            engine.add_request(p, params)
        for _ in range(4):  # prefill, then into steady decode
            engine.step()
        times = []
        prof = cProfile.Profile() if args.profile and B == max(int(b) for b in args.batch.split(",")) else None
        if prof:
            prof.enable()
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        if prof:
            prof.disable()
        print(f"B={B:4d}: {statistics.median(times) * 1e3:.3f} ms/step (median of {args.steps}), "
              f"{statistics.median(times) / B * 1e6:.2f} us per sequence")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
