"""Planner vs reality: predicted peak GPU memory (`moeloop.plan.predict_peak_bytes`) beside the measured
`torch.cuda.max_memory_allocated()` of real actor updates, for several configs, in one run.

    python benchmarks/plan_vs_measured.py --device cuda            # H200: reference Qwen3-MoE, bf16
    python benchmarks/plan_vs_measured.py --size tiny --device cpu # plumbing check only (no CUDA counters)
"""
from __future__ import annotations

import argparse
import random

import torch

from moeloop.config import load_config
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict
from moeloop.plan import predict_peak_bytes
from moeloop.train.actor import Actor
from moeloop.types import Sample

CONFIGS = {  # name -> (token budget per micro-batch, sequences, prompt, response, gradient checkpointing)
    "budget8k": (8192, 32, 256, 256, False),
    "budget16k-ckpt": (16384, 64, 256, 256, True),
    "budget4k-long": (4096, 8, 1024, 1024, False),
}


def fake_batch(num_seqs: int, prompt: int, response: int, vocab: int) -> list[Sample]:
    rng = random.Random(0)
    return [Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                   response_ids=[rng.randrange(vocab) for _ in range(response)], group_id=i // 8,
                   reward_status="scored", advantages=[rng.uniform(-1, 1)] * response)
            for i in range(num_seqs)]


def measure(name: str, size: str, device: torch.device, dtype: str) -> tuple[int, int]:
    budget, seqs, prompt, response, ckpt = CONFIGS[name]
    hf = hf_config_dict("qwen3_moe", size)
    cfg = load_config(None, [
        "model.path=unused", f"model.dtype={dtype}", f"model.gradient_checkpointing={ckpt}", f"actor.max_tokens_per_micro_batch={budget}",
        f"data.train_batch_size={seqs // 8}", f"actor.ppo_mini_batch_size={seqs // 8}", "rollout.n=8",
        f"data.max_prompt_length={prompt}", f"data.max_response_length={response}", "rollout.mode=disaggregated"])
    cfg.plan.hf_config = hf
    predicted = predict_peak_bytes(cfg, ModelConfig.from_hf_dict(hf))
    model = build_model("qwen3_moe", size).to(getattr(torch, dtype))
    model.gradient_checkpointing = ckpt
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    actor = Actor(model, cfg.actor, device, response, cfg.model.logprob_chunk_tokens)
    for _ in range(2):  # the second step has the optimizer state allocated
        actor.update(fake_batch(seqs, prompt, response, hf["vocab_size"]))
    measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del actor, model
    return predicted, measured


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="reference", choices=["tiny", "small", "reference"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    device = torch.device(args.device)
    print(f"size={args.size} dtype={args.dtype} device={device} torch={torch.__version__}")
    print(f"{'config':<16} {'predicted GiB':>14} {'measured GiB':>13} {'error':>8}")
    for name in args.configs.split(","):
        predicted, measured = measure(name, args.size, device, args.dtype)
        err = (predicted - measured) / measured if measured else float("nan")
        print(f"{name:<16} {predicted / 2**30:>14.2f} {measured / 2**30:>13.2f} {err:>+8.1%}", flush=True)


if __name__ == "__main__":
    main()
