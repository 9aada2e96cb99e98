"""Token-level rewards of a sample: its scalar score on the last response token, minus an optional
per-token KL penalty (`use_kl_in_reward`).

`Sample` has no token-reward field, so `apply_kl_in_reward` stores the shaped rewards in
`sample.metadata[TOKEN_REWARDS_KEY]`; `token_rewards(sample)` reads them back (or builds the
outcome-only form). Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) use their sum as score.
"""
from __future__ import annotations

import torch

from moeloop.algo.kl import kl_estimate
from moeloop.config.schema import AlgorithmSection
from moeloop.types import Sample

TOKEN_REWARDS_KEY = "token_rewards"


def response_mask(sample: Sample) -> torch.Tensor:
    """Float64 [R] 0/1 mask of the response tokens that count: `sample.loss_mask` if set, all ones
    otherwise, all zeros for a masked sample."""
    return torch.tensor(response_mask_values(sample), dtype=torch.float64)


def response_mask_values(sample: Sample) -> list:
    """`response_mask` as a Python list (packing many samples converts once for all of them)."""
    num = len(sample.response_ids)
    if not sample.in_loss or sample.loss_mask is None:
        return [float(sample.in_loss)] * num
    if len(sample.loss_mask) != num:
        raise ValueError(f"loss_mask has {len(sample.loss_mask)} values for {num} response tokens")
    return sample.loss_mask


def token_rewards(sample: Sample) -> torch.Tensor:
    """Float64 [R] rewards per response token: the KL-shaped ones if set, else the score on the last token."""
    shaped = sample.metadata.get(TOKEN_REWARDS_KEY)
    if shaped is not None:
        if len(shaped) != len(sample.response_ids):
            raise ValueError(f"{TOKEN_REWARDS_KEY} has {len(shaped)} values for {len(sample.response_ids)} response tokens")
        return torch.tensor(shaped, dtype=torch.float64)
    rewards = torch.zeros(len(sample.response_ids), dtype=torch.float64)
    if len(rewards):
        rewards[-1] = sample.reward
    return rewards


def sequence_score(sample: Sample) -> float:
    """Scalar score an outcome estimator sees: the sum of the token rewards (verl)."""
    return float(token_rewards(sample).sum()) if sample.response_ids else float(sample.reward)


def apply_kl_in_reward(samples: list[Sample], cfg: AlgorithmSection, coef: float | None = None) -> float:
    """Write reward - coef * kl(old || ref) per token into each in-loss sample (coef: `cfg.kl_coef` unless given,
    e.g. by the adaptive `KLController`); return the mean KL per token.

    Needs `old_logprobs` and `ref_logprobs` on every in-loss sample. A no-op returning 0.0 when
    `cfg.use_kl_in_reward` is off. Masked samples are skipped and do not enter the mean.
    """
    kl_sum, num_tokens = kl_in_reward_sums(samples, cfg, coef)
    return kl_sum / max(num_tokens, 1)


def kl_in_reward_sums(samples: list[Sample], cfg: AlgorithmSection, coef: float | None = None) -> tuple[float, int]:
    """`apply_kl_in_reward`'s work; returns (sum of the per-token KL, number of tokens) of these samples, for a
    mean over DP ranks."""
    if not cfg.use_kl_in_reward:
        return 0.0, 0
    coef = cfg.kl_coef if coef is None else coef
    kl_sum, num_tokens = 0.0, 0
    for i, sample in enumerate(samples):
        if not sample.in_loss:
            continue
        if sample.old_logprobs is None or sample.ref_logprobs is None:
            raise ValueError(f"sample {i}: use_kl_in_reward needs old_logprobs and ref_logprobs")
        old = torch.tensor(sample.old_logprobs, dtype=torch.float64)
        ref = torch.tensor(sample.ref_logprobs, dtype=torch.float64)
        if len(old) != len(sample.response_ids):
            raise ValueError(f"sample {i}: {len(old)} old_logprobs for {len(sample.response_ids)} response tokens")
        mask = torch.tensor(response_mask_values(sample), dtype=torch.float64)  # (a tool turn's tokens: no KL)
        kl = kl_estimate(old, ref, cfg.kl_penalty) * mask
        sample.metadata.pop(TOKEN_REWARDS_KEY, None)
        sample.metadata[TOKEN_REWARDS_KEY] = (token_rewards(sample) - coef * kl).tolist()
        kl_sum, num_tokens = kl_sum + float(kl.sum()), num_tokens + int(mask.sum())
    return kl_sum, num_tokens
