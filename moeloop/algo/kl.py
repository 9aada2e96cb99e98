"""Token-level KL estimators between the policy and a reference model (Schulman's k1, k2, k3).

`kl_estimate(logprobs, ref_logprobs, kind)` returns one value per token; k3 (= low_var_kl) is
clamped to [-10, 10] like verl, so a single far-off token cannot blow up the loss.
"""
from __future__ import annotations

from typing import Callable

import torch

KL_CLAMP = 10.0  # k3 value clamp (verl)
LOG_RATIO_CLAMP = 20.0  # clamp of log(ref/pi) before exp in k3 (verl)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref: unbiased, high variance, can be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log ref)^2: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1 (low_var_kl): unbiased, >= 0; clamped to [-10, 10]."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(-KL_CLAMP, KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate of type `kind` (k1 | k2 | k3 | low_var_kl)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {'|'.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ in shape")
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)
