"""Advantage estimators over a batch of `Sample`: grpo (and Dr.GRPO), rloo, reinforce_pp,
reinforce_pp_baseline, gae and remax; each writes per-response-token `sample.advantages` (gae, reinforce_pp and
remax also `returns`).

Semantics follow verl's core_algos. Masked samples (`not sample.in_loss`) are left out of every
group baseline and batch statistic and get zero advantages. A group (same `group_id`) with a
single in-loss sample has no baseline: its advantage is its score (verl's convention).
Call `compute_advantages(samples, cfg.algorithm)`; estimators work in float64. Under data parallelism each
rank passes its own samples (whole groups); the batch statistics of the whitening estimators (reinforce_pp,
reinforce_pp_baseline, gae) are all-reduced, so every rank whitens with the global batch's mean and variance.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from moeloop.algo.token_rewards import response_mask, sequence_score, token_rewards
from moeloop.config.schema import AlgorithmSection
from moeloop.parallel.collectives import global_values
from moeloop.types import Sample

GRPO_EPS = 1e-6  # added to the group std
WHITEN_EPS = 1e-8  # added to the batch variance inside rsqrt (verl masked_whiten)


def _groups(samples: list[Sample]) -> dict[int, list[int]]:
    """group_id -> indices of its in-loss samples."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        if sample.in_loss:
            groups[sample.group_id].append(i)
    return groups


def _write_outcome(samples: list[Sample], scores: dict[int, float]) -> None:
    """Broadcast one advantage per sample over its response tokens; zero where not in `scores`."""
    for i, sample in enumerate(samples):
        sample.advantages = (response_mask(sample) * scores.get(i, 0.0)).tolist()


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whiten per-token values across the whole batch over masked tokens (unbiased variance),
    zero outside the mask. Fewer than 2 tokens: centre only. Under DP the batch is every rank's tokens."""
    flat_v = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    flat_m = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.float64)
    total, count = global_values([float((flat_v * flat_m).sum()), float(flat_m.sum())])
    if count == 0:
        return [torch.zeros_like(v) for v in values]
    mean = total / count
    (sq,) = global_values([float(((flat_v - mean).square() * flat_m).sum())])
    var = torch.tensor(sq / (count - 1) if count > 1 else 0.0, dtype=torch.float64)
    return [(v - mean) * torch.rsqrt(var + WHITEN_EPS) * m for v, m in zip(values, masks)]


def grpo(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """A_i = (s_i - mean_g) / (std + 1e-6) (unbiased std), or s_i - mean_g when not norm_adv_by_std (Dr.GRPO). The
    std is the group's (algorithm.adv_std_scope=group), or that of every in-loss score of the batch, all DP ranks'
    (batch: TRL's scale_rewards="batch")."""
    scores: dict[int, float] = {}
    batch_std = _batch_score_std(samples) if cfg.adv_std_scope == "batch" else None
    for members in _groups(samples).values():
        s = torch.tensor([sequence_score(samples[i]) for i in members], dtype=torch.float64)
        if len(s) == 1:
            mean, std = s.new_zeros(()), s.new_ones(())
        else:
            mean, std = s.mean(), s.std()
        std = std if batch_std is None else batch_std
        adv = (s - mean) / (std + GRPO_EPS) if cfg.norm_adv_by_std else s - mean
        scores.update(zip(members, adv.tolist()))
    _write_outcome(samples, scores)


def _batch_score_std(samples: list[Sample]) -> torch.Tensor:
    """The unbiased std of every in-loss sample's score over the DP ranks' batch (0 for fewer than 2)."""
    values = [sequence_score(s) for s in samples if s.in_loss]
    total, count = global_values([sum(values), len(values)])
    mean = total / count if count else 0.0
    (squares,) = global_values([sum((v - mean) ** 2 for v in values)])
    return torch.tensor((squares / (count - 1)) ** 0.5 if count > 1 else 0.0, dtype=torch.float64)


def rloo(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """A_i = s_i - mean of the other in-loss samples of the group (= n/(n-1) (s_i - mean_g))."""
    scores: dict[int, float] = {}
    for members in _groups(samples).values():
        s = torch.tensor([sequence_score(samples[i]) for i in members], dtype=torch.float64)
        n = len(s)
        adv = s if n == 1 else s - (s.sum() - s) / (n - 1)
        scores.update(zip(members, adv.tolist()))
    _write_outcome(samples, scores)


def over_actions(fn, mask: torch.Tensor, *series: torch.Tensor) -> torch.Tensor:
    """`fn` of the series at the tokens in the loss only (the policy's actions), scattered back; 0 elsewhere. The
    tokens out of the loss are transparent: a multi-turn sample's tool turns (`loop.multi_turn`) are the
    environment's, so returns and GAE run from the action before them to the action after them (verl's multi-turn
    GAE does the same)."""
    keep = mask.bool()
    out = torch.zeros_like(series[0])
    out[keep] = fn(*(x[keep] for x in series))
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over the tokens in the loss (`over_actions`); 0 at the others."""
    def returns_of(r: torch.Tensor) -> torch.Tensor:
        out, running = torch.zeros_like(r), torch.zeros((), dtype=r.dtype)
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            out[t] = running
        return out
    return over_actions(returns_of, mask, rewards)


def reinforce_pp(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """REINFORCE++: discounted token-level returns (KL-shaped rewards if applied), whitened over the batch."""
    masks = [response_mask(s) for s in samples]
    returns = [discounted_returns(token_rewards(s), m, cfg.gamma) * m for s, m in zip(samples, masks)]
    for sample, ret, adv in zip(samples, returns, whiten(returns, masks)):
        sample.returns, sample.advantages = ret.tolist(), adv.tolist()


def reinforce_pp_baseline(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """REINFORCE++-baseline: s_i - mean_g broadcast over the response, then whitened over the batch."""
    centred: dict[int, float] = {}
    for members in _groups(samples).values():
        s = torch.tensor([sequence_score(samples[i]) for i in members], dtype=torch.float64)
        centred.update(zip(members, (s - s.mean() if len(s) > 1 else s).tolist()))
    masks = [response_mask(s) for s in samples]
    values = [m * centred.get(i, 0.0) for i, m in enumerate(masks)]
    for sample, adv in zip(samples, whiten(values, masks)):
        sample.advantages = adv.tolist()


def gae_one(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimate of one response (value after the last token = 0)."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros((), dtype=rewards.dtype)
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def gae(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """GAE with the critic's `sample.values`: returns = adv + values, then adv whitened over the batch."""
    masks, raw = [response_mask(s) for s in samples], []
    for i, sample in enumerate(samples):
        if not sample.in_loss:
            raw.append(torch.zeros(len(sample.response_ids), dtype=torch.float64))
            sample.returns = raw[-1].tolist()
            continue
        if sample.values is None or len(sample.values) != len(sample.response_ids):
            raise ValueError(f"sample {i}: gae needs one critic value per response token in sample.values")
        values = torch.tensor(sample.values, dtype=torch.float64)
        raw.append(over_actions(lambda r, v: gae_one(r, v, cfg.gamma, cfg.lam), masks[i], token_rewards(sample), values))
        sample.returns = (raw[-1] + values).tolist()
    for sample, adv in zip(samples, whiten(raw, masks)):
        sample.advantages = adv.tolist()


def remax(samples: list[Sample], cfg: AlgorithmSection) -> None:
    """ReMax (Li et al. 2023): A_t = G_t - b, G the discounted token-level return (KL-shaped rewards if applied) and
    b the reward of the prompt's greedy response (`sample.baseline`); no whitening (verl's remax). A sample whose
    baseline fell back (None) gets zero advantages: there is nothing to compare it with."""
    for sample in samples:
        mask = response_mask(sample)
        returns = discounted_returns(token_rewards(sample), mask, cfg.gamma) * mask
        baseline = sample.baseline if sample.baseline is not None and sample.in_loss else None
        sample.returns = returns.tolist()
        sample.advantages = ((returns - baseline) * mask if baseline is not None else mask * 0.0).tolist()


ADV_ESTIMATORS: dict[str, Callable[[list[Sample], AlgorithmSection], None]] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae,
    "remax": remax,
}


def compute_advantages(samples: list[Sample], cfg: AlgorithmSection) -> list[Sample]:
    """Fill `advantages` (and `returns` for reinforce_pp / gae) of every sample in place; returns the list."""
    if cfg.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator!r}; expected one of {'|'.join(ADV_ESTIMATORS)}")
    ADV_ESTIMATORS[cfg.adv_estimator](samples, cfg)
    return samples
