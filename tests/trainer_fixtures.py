"""Tiny model + synthetic RL batch shared by the trainer, checkpoint and DP tests."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from moeloop.config.schema import ActorSection
from moeloop.model.config import ModelConfig
from moeloop.model.transformer import MoEForCausalLM
from moeloop.types import Sample

TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 96, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 256,
}


def tiny_model(seed: int = 0, **overrides) -> MoEForCausalLM:
    """`TINY_QWEN3_MOE` (with `overrides` of its config fields), seeded: N(0, 0.1) matrices, unit vectors."""
    torch.manual_seed(seed)
    model = MoEForCausalLM(ModelConfig.from_hf_dict({**TINY_QWEN3_MOE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.fill_(1.0)
    return model


def rl_batch(num_groups: int = 4, n: int = 3, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(1, 96) for _ in range(rng.randint(2, 7))]
        for _ in range(n):
            resp = [rng.randrange(1, 96) for _ in range(rng.randint(1, 6))]
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, group_id=g, reward=rng.random(),
                                  reward_status="scored",
                                  old_logprobs=[-2.0 - rng.random() for _ in resp],
                                  advantages=[rng.uniform(-1, 1)] * len(resp)))
    return samples


def actor_cfg(**overrides) -> ActorSection:
    cfg = ActorSection()
    cfg.optim.lr = 1e-2
    cfg.ppo_mini_batch_size = 4
    cfg.grad_clip = 0.0
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def use_sgd(actor, lr: float) -> None:
    """Exact-equivalence tests use SGD: Adam magnifies fp32 reduction-order noise (notes/cpu-stack.md)."""
    actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=lr)
    actor.scheduler = torch.optim.lr_scheduler.LambdaLR(actor.optimizer, lambda step: 1.0)


def first_pass_then_steps(model, samples: list[Sample], kind: str, metrics: tuple[str, ...] = ("pg_loss",)):
    """The old logprobs and entropies of `samples` (kind "r2": the routes recorded too), then 2 SFT steps (kind "sft")
    or, after an update with every advantage 0 (nothing to train), 2 GRPO updates; returns the first pass's values by
    sample and the steps' `metrics` (the SFT loss for SFT), in order. For the parallel layouts' tests."""
    model.compute_logprobs(samples, "old_logprobs", routes="record" if kind == "r2" else "off",
                           entropy_field="old_entropy")
    first = {(s.group_id, tuple(s.response_ids)): (s.old_logprobs, s.old_entropy)
             + ((torch.as_tensor(s.routed_experts),) if kind == "r2" else ()) for s in samples}
    if kind == "sft":
        return first, [model.sft_step(samples)["sft_loss"] for _ in range(2)]
    model.update([replace(s, advantages=[0.0] * len(s.advantages)) for s in samples])
    return first, [m[k] for m in (model.update(samples) for _ in range(2)) for k in metrics]


def assert_ranks_match(ranks, want_first: dict, want_metrics: list, want_weights: dict) -> None:
    """Each rank's (first-pass values by sample, step metrics, weights) against one process's: the ranks' samples
    together are its samples, and each rank's values of its samples are its (the ranks that share samples, tensor,
    context or pipeline parallel ones, each checked); every rank's metrics and weights are its (fp32 summation
    order)."""
    seen = set()
    for first, metrics, weights in ranks:
        seen |= first.keys()
        for key, got_values in first.items():
            for got, value in zip(got_values, want_first[key], strict=True):
                torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(value), rtol=1e-5, atol=1e-5)
        assert metrics == pytest.approx(want_metrics, rel=1e-5)
        for name, w in want_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
    assert seen == want_first.keys()
