"""Training-inference mismatch: the rollout engine's logprob of each sampled token against the trainer's
teacher-forced logprob of the same token (the actor's `compute_logprobs`, as the RL loop's old-logprob pass).

    python benchmarks/logprob_mismatch.py --device cuda --size reference [--dtype bfloat16]
    MOELOOP_KERNELS=off python benchmarks/logprob_mismatch.py ...   # both sides on torch ops

The engine samples at temperature 1 and returns the policy's own logprobs, so in exact arithmetic the two are
equal; what differs is rounding (decode GEMVs and paged attention against training GEMMs and packed attention).
A PPO/GRPO importance ratio built from engine logprobs (bypass mode) inherits the difference as exp(diff) - 1.
Printed: mean, p99 and max |diff| over response tokens, mean |ratio - 1|, and the share of tokens whose ratio
leaves the PPO clip range [0.8, 1.2]. Same job as the e2e reference run: 16 prompts x 8 samples x 256 tokens.
"""
from __future__ import annotations

import argparse
import copy
import math
import os

import torch

from moeloop.model.factory import build_model
from moeloop.rollout import SamplingParams
from moeloop.train.actor import PolicyForward
from moeloop.types import Sample
from sized_engine import sized_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model = build_model(args.arch, args.size, seed=0).to(device=args.device, dtype=dtype).eval()
    trainer_model = copy.deepcopy(model)  # the trainer swaps in its chunked logprob head
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.cfg.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    B, total = args.prompts * args.n, args.prompt_len + args.new_tokens
    engine = sized_engine(model, B, args.prompt_len, args.new_tokens)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, seed=0, logprobs=True)
    outs = engine.generate(prompts, params)
    samples = [Sample(prompt_ids=o.prompt_ids, response_ids=o.response_ids, response_logprobs=o.logprobs,
                      group_id=i // args.n) for i, o in enumerate(outs)]
    actor = PolicyForward(trainer_model, torch.device(args.device), max_tokens_per_micro_batch=B * total,
                          chunk_tokens=1024)
    actor.compute_logprobs(samples, "old_logprobs")
    diff = torch.tensor([a - b for s in samples for a, b in zip(s.response_logprobs, s.old_logprobs)],
                        dtype=torch.float64)
    ratio_dev = (diff.exp() - 1).abs()  # exp(engine - trainer) - 1: the bypass-mode importance ratio's error
    absd = diff.abs()
    print(f"# {args.arch}/{args.size} {args.dtype} on {args.device}, kernels "
          f"{os.environ.get('MOELOOP_KERNELS', 'on')}; {B} samples x {args.new_tokens} tokens = {diff.numel()} tokens")
    print(f"|engine - trainer logprob|: mean {absd.mean():.3e}, p99 {absd.quantile(0.99):.3e}, max {absd.max():.3e}; "
          f"mean |ratio - 1| {ratio_dev.mean():.3e}; ratio outside [0.8, 1.2]: "
          f"{100 * ((diff.exp() < 0.8) | (diff.exp() > 1.2)).double().mean():.3f}% of tokens; "
          f"mean engine logprob {diff.new_tensor([x for s in samples for x in s.response_logprobs]).mean():.3f} "
          f"(uniform: {-math.log(model.cfg.vocab_size):.3f})")


if __name__ == "__main__":
    main()
