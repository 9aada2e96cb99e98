"""How far the trainer's logprobs sit from the rollout engine's, with and without router replay (R3), and what
recording the routes costs the engine; one run, one model, the same prompts.

    python benchmarks/router_replay.py                                              # CPU, tiny model, fp32
    python benchmarks/router_replay.py --device cuda --size reference --batch 32   # H200, bf16

Rows:
- fused engine, no replay: the default engine (on CUDA the fused decode forward), the trainer routing afresh;
- recording engine, no replay: the engine with rollout.record_routes (module decode forward), the trainer routing
  afresh; the routes column counts the (token, MoE layer) choices where the trainer's experts differ;
- recording engine, R3 replay: the same samples, the trainer routing through the engine's recorded experts.
Mismatch columns over every sampled token: mean and max |logp_engine - logp_trainer|, and the mean k3 estimate of
KL(engine || trainer) (exp(d) - 1 - d, d = logp_trainer - logp_engine). Decode tok/s: the generate's tokens over its
wall time, the best of --repeats runs (prefill included, so read it as a ratio between the two engines).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from moeloop.model.factory import build_model
from moeloop.model.routes import RouteTape
from moeloop.rollout import SamplingParams, completions_to_samples
from moeloop.train.actor import packed_hidden
from moeloop.train.packing import pack_samples, unpack_routes
from sized_engine import sized_engine


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model, prompts, new_tokens: int, device: str, repeats: int, record: bool):
    """(completions of the last run, best wall seconds)."""
    engine = sized_engine(model, len(prompts), len(prompts[0]), new_tokens, record_routes=record)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=min(new_tokens, 24), seed=1))  # warm-up
    engine.blocks.reset_prefix_cache()
    best, outs = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(device)
        best = min(best, time.perf_counter() - t)
        engine.blocks.reset_prefix_cache()
    return outs, best


@torch.no_grad()
def trainer_logprobs(model, samples, replay: bool, per_batch: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the trainer's logprob of every sampled token, flat; per sample its own routes [positions, L, K])."""
    logps, routes = [], []
    for i in range(0, len(samples), per_batch):
        part = samples[i:i + per_batch]
        batch = pack_samples(part).to(next(model.parameters()).device)
        tape = RouteTape(batch.replay_routes if replay else None, batch.replay_valid if replay else None, record=True)
        hidden = packed_hidden(model, batch, tape)
        for seq, sample in enumerate(part):
            rows = hidden[batch.response_slice(seq)]
            logits = model.compute_logits(rows).float()
            ids = torch.tensor(sample.response_ids, device=logits.device)
            logps.append(torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0].cpu().numpy())
        routes += unpack_routes(batch, tape.stacked())
    return np.concatenate(logps), routes


def mismatch(engine_lp: np.ndarray, trainer_lp: np.ndarray) -> tuple[float, float, float]:
    d = trainer_lp.astype(np.float64) - engine_lp
    return float(np.abs(d).mean()), float(np.abs(d).max()), float((np.exp(d) - 1 - d).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "reference"])
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trainer-batch", type=int, default=8, help="sequences per trainer forward")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = build_model(args.arch, args.size, seed=0).to(device=args.device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    print(f"# {args.arch}/{args.size} {dtype} on {args.device}; {args.batch} prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, temperature 1; torch {torch.__version__}")
    fused, fused_s = generate(model, prompts, args.new_tokens, args.device, args.repeats, record=False)
    recorded, rec_s = generate(model, prompts, args.new_tokens, args.device, args.repeats, record=True)
    tokens = args.batch * args.new_tokens
    print("| engine | trainer | gen tok/s | mean abs dlogp | max abs dlogp | mean k3 KL | routes differing |")
    print("|---|---|---|---|---|---|---|")
    for name, outs, secs, replay in (("fused", fused, fused_s, False), ("recording", recorded, rec_s, False),
                                     ("recording", recorded, rec_s, True)):
        samples = completions_to_samples(outs)
        engine_lp = np.concatenate([np.asarray(o.logprobs, dtype=np.float64) for o in outs])
        trainer_lp, routes = trainer_logprobs(model, samples, replay, args.trainer_batch)
        mean_d, max_d, kl = mismatch(engine_lp, trainer_lp)
        differ = "n/a"
        if outs[0].routed_experts is not None:
            diff = sum(int((np.sort(r, -1) != np.sort(o.routed_experts, -1)).any(-1).sum())
                       for r, o in zip(routes, outs))
            total = sum(o.routed_experts.shape[0] * o.routed_experts.shape[1] for o in outs)
            differ = f"{diff}/{total} ({100 * diff / total:.2f}%)"
        print(f"| {name} | {'R3 replay' if replay else 'own routing'} | {tokens / secs:,.0f} | {mean_d:.3e} | "
              f"{max_d:.3e} | {kl:.3e} | {differ} |")


if __name__ == "__main__":
    main()
