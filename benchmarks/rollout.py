"""Decode throughput of the moeloop rollout engine vs transformers `generate`, same model/prompts/lengths,
with the memory roofline of each decode step.

    python benchmarks/rollout.py                                  # CPU, tiny model
    python benchmarks/rollout.py --device cuda --size reference --batch 1,32,256

decode tok/s = B * (N - 1) / (wall(N new tokens) - wall(1 new token)), each wall the fastest of --repeats runs,
the N-token and 1-token runs in alternation (so that a slow phase of the host hits both): the decode steps only, as in
shared/notes/gpu-anchors.md. Roofline bytes per decode step = dense weights without the embedding
+ E * (1 - (1 - k/E)^B) distinct experts per MoE layer + the mean KV cache read; over the measured
device copy bandwidth (read + write bytes / time). Sampling: temperature 1, top-k 50 for both engines (transformers'
default; `--top-k 0`: no filter, the RL rollout's own distribution).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from moeloop.model.experts import Experts
from moeloop.model.factory import build_model
from moeloop.rollout import SamplingParams
from moeloop.rollout.kv_cache import kv_bytes_per_block
from sized_engine import sized_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, device: str) -> float:
    """Seconds of one dst.copy_(src): CUDA events on a GPU, the host timer on a CPU."""
    if not device.startswith("cuda"):
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bandwidth_bytes_per_s(device: str, trials: int = 20) -> float:
    """(read + write) bytes per second of a large device-to-device copy, the best of `trials` (`copy_seconds`):
    the ceiling the roofline divides by. A median of 5 moved by up to 4.5% from one process to the next on the
    H200 (BENCHMARKS.md, session 14), and the roofline percentage with it; the best is the steadier ceiling and
    never flatters the percentage."""
    n = (2 << 30) if device.startswith("cuda") else (256 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n / min(copy_seconds(dst, src, device) for _ in range(trials))


def roofline(model, batch: int, prompt_len: int, new_tokens: int, bw: float) -> tuple[float, float]:
    """(bytes per decode step, roofline decode tok/s) for batch B."""
    cfg = model.cfg
    elem = next(model.parameters()).element_size()
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_params = sum(p.numel() for m in experts for p in m.parameters())
    dense = sum(p.numel() for p in model.parameters()) - expert_params - model.model.embed_tokens.weight.numel()
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    per_expert = expert_params / (len(experts) * E) if experts else 0
    touched = E * (1 - (1 - k / E) ** batch) if E else 0
    kv_per_token = kv_bytes_per_block(cfg, 1, next(model.parameters()).dtype)
    mean_ctx = prompt_len + new_tokens / 2
    step_bytes = (dense + len(experts) * touched * per_expert) * elem + batch * mean_ctx * kv_per_token
    return step_bytes, batch / (step_bytes / bw)


def walls(run, n: int, device: str, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` runs of run(n) and of run(1), in alternation. decode tok/s is the difference of the
    fastest of each: a host stall only ever adds time, and the prompt's prefill (host-bound at B=1, 21-37 ms from
    one process to the next) is in both. Session 13 saw B=1 at 36.7% and 43.0% of the roofline from the same code
    when the 1-token runs all came after the N-token ones: the prefill was slow through one batch of runs."""
    full, one = [], []
    for _ in range(repeats):
        for k, times in ((n, full), (1, one)):
            sync(device)
            t = time.perf_counter()
            run(k)
            sync(device)
            times.append(time.perf_counter() - t)
    return full, one


def bench_moeloop(model, prompts: list[list[int]], new_tokens: int, device: str, repeats: int,
                  step_times: bool = False, decode_steps: int = 0,
                  top_k: int = 50, record_routes: bool = False,
                  penalties: dict | None = None) -> tuple[float, float, float | None]:
    """(fastest wall of the full runs, of the 1-token runs, with `step_times` the engine.step median per decode step
    in seconds: the median launch's ms over the steps a launch runs, K, or None)."""
    B, P = len(prompts), len(prompts[0])
    engine = sized_engine(model, B, P, new_tokens, decode_steps=decode_steps, record_routes=record_routes)

    def run(n: int):
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, top_k=top_k or -1, max_tokens=n, seed=0,
                                                       **(penalties or {})))
        assert all(len(o.response_ids) == n for o in outs)
        engine.blocks.reset_prefix_cache()  # the next call prefills again, like the first

    # warm-up: kernels, graph capture; 3K tokens take every multi-step graph (K = 8: 1 + 8 + 8 + 4 + 2 + 1)
    run(min(new_tokens, 3 * engine.runner.decode_steps))
    graphs = engine.runner.graphs
    if graphs is not None and graphs.capture_s:
        print(f"# B={B} CUDA graph capture s: " + ", ".join(f"{k} {v:.2f}" for k, v in graphs.capture_s.items()),
              flush=True)
    if step_times:  # one more full run with each engine.step timed on the host (diagnostic)
        times, step = [], engine.step

        def timed_step():
            t = time.perf_counter()
            out = step()
            times.append(time.perf_counter() - t)
            return out
        engine.step = timed_step
        run(new_tokens)
        engine.step = step
        ms = sorted(1e3 * t for t in times)
        print(f"# B={B} engine.step ms over {len(ms)} calls (up to {engine.runner.decode_steps} decode steps each): "
              f"median {statistics.median(ms):.3f}, p90 "
              f"{ms[int(0.9 * len(ms))]:.3f}, max {ms[-1]:.2f}, sum {sum(ms):.1f}; steps over 2 ms: "
              f"{sum(t > 2 for t in ms)} ({sum(t for t in ms if t > 2):.1f} ms)", flush=True)
    full, one = walls(run, new_tokens, device, repeats)
    step_s = None
    if step_times:
        print(f"# B={B} walls ms, {new_tokens} new tokens: {' '.join(f'{1e3 * t:.1f}' for t in full)}; 1 new token: "
              f"{' '.join(f'{1e3 * t:.1f}' for t in one)}", flush=True)
        step_s = statistics.median(times) / engine.runner.decode_steps
    return min(full), min(one), step_s


def bench_transformers(hf, prompts: list[list[int]], new_tokens: int, device: str, repeats: int,
                       top_k: int = 50) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(n: int):
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                          top_k=top_k, temperature=1.0, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n

    run(4)
    full, one = walls(run, new_tokens, device, repeats)
    return min(full), min(one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "reference"])
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per length, the fastest kept (host stalls only add time: `walls`)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--top-k", type=int, default=50, help="both engines' top-k (0: none, as RL samples)")
    ap.add_argument("--record-routes", action="store_true", help="rollout.record_routes (router replay R3: the "
                    "module decode forward, each completion's experts read back)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="moeloop's sampling (1: off)")
    ap.add_argument("--min-p", type=float, default=0.0, help="moeloop's sampling (0: off)")
    ap.add_argument("--step-times", action="store_true", help="also print the spread of engine.step host times")
    ap.add_argument("--decode-steps", type=int, default=0, help="rollout.decode_steps (0: auto, 8 on CUDA; 1: one "
                    "decode step per launch)")
    ap.add_argument("--hf-new-tokens", default="", help="B:N,... fewer new tokens for transformers at batch B "
                    "(its decode is slow at large B); its tok/s is still decode steps only")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    model = build_model(args.arch, args.size, seed=0).to(device=args.device, dtype=dtype).eval()
    hf = None
    if not args.skip_hf:
        hf_cfg = transformers.AutoConfig.for_model(**model.cfg.hf_config)
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
        hf.load_state_dict(model.state_dict())
        hf.to(args.device)
    bw = copy_bandwidth_bytes_per_s(args.device)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"# {args.arch}/{args.size} ({nparams / 1e6:.1f}M params, {dtype}) on {args.device}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {f'top-k {args.top_k}' if args.top_k else 'unfiltered'} sampling; copy bandwidth {bw / 1e9:.1f} GB/s (read+write)")
    print("| B | moeloop gen tok/s | moeloop decode tok/s | ms/step | HF decode tok/s | moeloop/HF | "
          "bytes/step | roofline tok/s | moeloop/roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    hf_tokens = {int(b): int(n) for b, n in (x.split(":") for x in args.hf_new_tokens.split(",") if x)}
    for B in [int(b) for b in args.batch.split(",")]:
        prompts = torch.randint(3, model.cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
        full, one, step_s = bench_moeloop(model, prompts, args.new_tokens, args.device, args.repeats,
                                          args.step_times, args.decode_steps, args.top_k, args.record_routes,
                                          dict(repetition_penalty=args.repetition_penalty, min_p=args.min_p))
        decode = B * (args.new_tokens - 1) / (full - one)
        hf_decode = float("nan")
        if hf is not None:
            n = hf_tokens.get(B, args.new_tokens)
            hf_full, hf_one = bench_transformers(hf, prompts, n, args.device, args.repeats, args.top_k)
            hf_decode = B * (n - 1) / (hf_full - hf_one)
        step_bytes, roof = roofline(model, B, args.prompt_len, args.new_tokens, bw)
        ms_step = 1e3 * (full - one) / (args.new_tokens - 1)
        if step_s is not None:  # the figure the sessions' notes worked out by hand from the median
            print(f"# B={B} by the engine.step median: {1e6 * step_s:.1f} us a decode step, {B / step_s:,.0f} tok/s, "
                  f"{100 * B / step_s / roof:.1f}% of the roofline", flush=True)
        hf_note = f" ({hf_tokens[B]} new)" if B in hf_tokens and hf is not None else ""
        print(f"| {B} | {B * args.new_tokens / full:,.0f} | {decode:,.0f} | {ms_step:.2f} "
              f"| {hf_decode:,.0f}{hf_note} | {decode / hf_decode:.2f}x | {step_bytes / 1e9:.3f} GB | {roof:,.0f} "
              f"| {100 * decode / roof:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
