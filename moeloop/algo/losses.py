"""Actor and critic losses on flat packed tokens: PPO clip (DAPO clip-higher, dual-clip), GSPO, CISPO, SAPO,
importance weights of the rollout/trainer mismatch (truncated or masked, per token or per sequence), off-policy
sequence masking, KL-to-reference loss, entropy bonus, clipped value loss, all aggregated with a global denominator.

Usage per micro-batch (see moeloop.algo.aggregation and moeloop.train.packing):
    denom = global_loss_denominators(mini_batch_samples, cfg.loss_agg_mode, max_response_length)
    for mb in micro_batches:
        loss, metrics = actor_loss(PolicyInputs(...mb tensors...), cfg.actor, denom)
        loss.backward()                       # shares add up to the mini-batch loss
    metrics = reduce_metrics(all_micro_batch_metrics)
Every `*_T` tensor is [T] over the packed tokens, aligned as `PackedBatch` documents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moeloop.algo.aggregation import aggregate_loss, per_seq_sum, seq_ids
from moeloop.algo.kl import kl_estimate
from moeloop.config.schema import ActorSection, CriticSection

LOG_RATIO_CLAMP = 20.0  # PPO: clamp log(pi/pi_old) before exp (verl)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO: clamp of the sequence log-ratio (verl)
SHARE_KEYS = ("pg_loss", "kl_loss", "entropy_loss", "vf_loss")  # metrics that add over micro-batches


@dataclass
class PolicyInputs:
    """One micro-batch of packed per-token tensors for the actor loss."""

    logprobs_T: torch.Tensor  # current policy, requires grad
    old_logprobs_T: torch.Tensor
    advantages_T: torch.Tensor
    loss_mask_T: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [S+1]
    ref_logprobs_T: Optional[torch.Tensor] = None  # needed when use_kl_loss
    entropy_T: Optional[torch.Tensor] = None  # needed when entropy_coeff != 0
    rollout_logprobs_T: Optional[torch.Tensor] = None  # the engine's logprobs; needed when tis_cap > 0
    pg_keep_T: Optional[torch.Tensor] = None  # 0/1: the tokens the policy-gradient term keeps (top-entropy selection)

    def check(self) -> None:
        shape = self.logprobs_T.shape
        for name in ("old_logprobs_T", "advantages_T", "loss_mask_T", "ref_logprobs_T", "entropy_T", "rollout_logprobs_T",
                     "pg_keep_T"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, logprobs_T has {tuple(shape)}")


def _masked_mean(values_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Mean over the mask's positions in fp64 (0 with none), as a device scalar: no host sync."""
    mask = mask_T.bool()
    return torch.where(mask, values_T.detach().double(), 0.0).sum() / mask.sum().clamp(min=1)


def metrics_to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Device scalars to Python floats in one host transfer."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        out.update(zip(keys, torch.stack([metrics[k].detach().double() for k in keys]).tolist()))
    return {k: out[k] for k in metrics}


def ppo_clip_loss_T(
    logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor,
    clip_low: float, clip_high: float, clip_c: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A r, -A clip(r, 1-low, 1+high)); for A < 0 also capped at -A * clip_c
    (dual-clip) unless clip_c is None. Returns (loss_T, ratio_T)."""
    ratio = (logprobs_T - old_logprobs_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    clipped = torch.maximum(-advantages_T * ratio, -advantages_T * ratio.clamp(1 - clip_low, 1 + clip_high))
    if clip_c is None:
        return clipped, ratio
    dual = torch.minimum(clipped, -advantages_T * clip_c)
    return torch.where(advantages_T < 0, dual, clipped), ratio


def _per_token_seq_sum(values_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each position's sequence total of `values_T`."""
    return per_seq_sum(values_T, cu_seqlens)[seq_ids(cu_seqlens, values_T.shape[0]).to(values_T.device)]


def gspo_ratio_T(logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """GSPO token form s_it = sg[s_i] * pi_t / sg[pi_t], s_i = exp(mean_t log(pi_t / pi_old_t)) over the
    sequence's loss tokens: its value is the sequence ratio s_i, its gradient s_i * grad log pi_t."""
    mask = loss_mask_T.to(logprobs_T.dtype)
    log_ratio_sum = _per_token_seq_sum((logprobs_T - old_logprobs_T).detach() * mask, cu_seqlens)
    token_seq_log_ratio = log_ratio_sum / _per_token_seq_sum(mask, cu_seqlens).clamp(min=1)
    log_ratio = logprobs_T - logprobs_T.detach() + token_seq_log_ratio
    return log_ratio.clamp(max=GSPO_LOG_RATIO_MAX).exp()


def gspo_loss_T(
    logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor, cu_seqlens: torch.Tensor, clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GSPO loss max(-A s, -A clip(s, 1-low, 1+high)) with the sequence ratio. Returns (loss_T, ratio_T)."""
    ratio = gspo_ratio_T(logprobs_T, old_logprobs_T, loss_mask_T, cu_seqlens)
    return torch.maximum(-advantages_T * ratio, -advantages_T * ratio.clamp(1 - clip_low, 1 + clip_high)), ratio


def cispo_loss_T(
    logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor, clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss (MiniMax-M1) -sg(clip(r, 1-low, 1+high)) * A * log pi: the importance weight is clipped
    and held fixed, so every token keeps the gradient -w A grad log pi, where PPO's clip zeroes it. Returns
    (loss_T, ratio_T)."""
    ratio = (logprobs_T - old_logprobs_T).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return -ratio.clamp(1 - clip_low, 1 + clip_high) * advantages_T * logprobs_T, ratio


def sapo_loss_T(
    logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor, tau_pos: float, tau_neg: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token SAPO loss (Soft Adaptive Policy Optimization) -A * (4 / tau) * sigmoid(tau * (r - 1)), tau =
    tau_pos where A > 0 else tau_neg: a smooth gate in place of the hard clip. Its gradient is -A grad r at r = 1
    (PPO's on-policy gradient) and fades as r leaves 1. Returns (loss_T, ratio_T)."""
    ratio = (logprobs_T - old_logprobs_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    tau = torch.full_like(ratio, tau_neg).masked_fill(advantages_T > 0, tau_pos)  # in the ratio's dtype
    return -advantages_T * torch.sigmoid(tau * (ratio - 1)) * 4 / tau, ratio


def _policy_loss_T(inputs: PolicyInputs, cfg: ActorSection) -> tuple[torch.Tensor, torch.Tensor]:
    logp, old, adv = inputs.logprobs_T, inputs.old_logprobs_T, inputs.advantages_T
    if cfg.policy_loss == "ppo":
        return ppo_clip_loss_T(logp, old, adv, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c)
    if cfg.policy_loss == "gspo":
        return gspo_loss_T(logp, old, adv, inputs.loss_mask_T, inputs.cu_seqlens, cfg.clip_ratio_low, cfg.clip_ratio_high)
    if cfg.policy_loss == "cispo":
        return cispo_loss_T(logp, old, adv, cfg.clip_ratio_low, cfg.clip_ratio_high)
    if cfg.policy_loss == "sapo":
        return sapo_loss_T(logp, old, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    raise ValueError(f"actor.policy_loss={cfg.policy_loss!r}; expected ppo|gspo|cispo|sapo")


def tis_weights_T(
    old_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor, cap: float, mode: str = "token_truncate",
    floor: float = 0.0, loss_mask_T: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Importance weights pi_old / pi_rollout for the rollout/trainer mismatch, no gradient (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): the rollout engine sampled the tokens, the
    loss's ratios are taken against the trainer's old logprobs, and the two differ by numerics (bf16 GEMM shapes,
    kernels, and for an MoE the experts a near tie routes to). token_*: one weight a token; sequence_*: the product
    over the sequence's loss tokens (needs loss_mask_T, cu_seqlens). *_truncate clamps the weight into [floor, cap]
    to bound the variance; *_mask zeroes the weights outside it (those tokens or sequences leave the loss)."""
    log_w = (old_logprobs_T - rollout_logprobs_T).detach()
    if mode.startswith("sequence"):
        log_w = _per_token_seq_sum(log_w * loss_mask_T.to(log_w.dtype), cu_seqlens)
    w = log_w.clamp(max=LOG_RATIO_CLAMP).exp()
    if mode.endswith("truncate"):
        return w.clamp(min=floor, max=cap)
    return torch.where((w >= floor) & (w <= cap), w, 0.0)


def off_policy_keep_T(inputs: PolicyInputs, threshold: float) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): 0 at the tokens of a sequence whose advantage is negative and
    whose mean KL(sampling || current) over its loss tokens, estimated as mean(log pi_sampling - log pi), exceeds
    `threshold`; 1 elsewhere. The sampling policy is the rollout's logprobs when present, else the old ones."""
    sampling = inputs.rollout_logprobs_T if inputs.rollout_logprobs_T is not None else inputs.old_logprobs_T
    mask = inputs.loss_mask_T.to(inputs.logprobs_T.dtype)
    kl_sum = _per_token_seq_sum((sampling - inputs.logprobs_T).detach() * mask, inputs.cu_seqlens)
    seq_kl_T = kl_sum / _per_token_seq_sum(mask, inputs.cu_seqlens).clamp(min=1)
    return ((inputs.advantages_T >= 0) | (seq_kl_T <= threshold)).to(inputs.logprobs_T.dtype)


def _ratio_metrics(inputs: PolicyInputs, ratio_T: torch.Tensor, cfg: ActorSection) -> dict[str, torch.Tensor | float]:
    adv, mask, r = inputs.advantages_T, inputs.loss_mask_T, ratio_T.detach()
    dual = cfg.policy_loss == "ppo"
    if cfg.policy_loss == "cispo":  # the weight is clipped whatever the advantage's sign
        high, low = r > 1 + cfg.clip_ratio_high, r < 1 - cfg.clip_ratio_low
    else:  # where PPO's clip takes the gradient away
        high, low = (adv > 0) & (r > 1 + cfg.clip_ratio_high), (adv < 0) & (r < 1 - cfg.clip_ratio_low)
    return {
        "pg_clipfrac_high": _masked_mean(high.float(), mask),
        "pg_clipfrac_low": _masked_mean(low.float(), mask),
        "pg_clipfrac_dual": _masked_mean(((adv < 0) & (r > cfg.clip_ratio_c)).float(), mask) if dual else 0.0,
        "ppo_kl": _masked_mean(inputs.old_logprobs_T - inputs.logprobs_T, mask),
        "num_loss_tokens": mask.bool().sum(),
    }


def _weighted_and_masked(pg_T: torch.Tensor, inputs: PolicyInputs,
                         cfg: ActorSection) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient term times the rollout importance weights (actor.tis_cap), the top-entropy selection
    (`inputs.pg_keep_T`) and the off-policy sequence mask, with their metrics."""
    metrics: dict[str, torch.Tensor] = {}
    mask = inputs.loss_mask_T
    if cfg.tis_cap > 0:
        if inputs.rollout_logprobs_T is None:
            raise ValueError("actor.tis_cap > 0 needs the rollout's logprobs (rollout_logprobs_T: "
                             "SamplingParams.logprobs on)")
        w_T = tis_weights_T(inputs.old_logprobs_T, inputs.rollout_logprobs_T, cfg.tis_cap, cfg.tis_mode,
                            cfg.tis_floor, mask, inputs.cu_seqlens)
        pg_T = pg_T * w_T
        metrics["tis_weight"] = _masked_mean(w_T, mask)
        if cfg.tis_mode.endswith("truncate"):
            clamped = (w_T >= cfg.tis_cap) | (w_T <= cfg.tis_floor) if cfg.tis_floor > 0 else w_T >= cfg.tis_cap
            metrics["tis_capped_frac"] = _masked_mean(clamped.float(), mask)
        else:
            metrics["tis_masked_frac"] = _masked_mean((w_T == 0).float(), mask)
    if inputs.pg_keep_T is not None:  # the KL and entropy terms keep every token
        pg_T = pg_T * inputs.pg_keep_T
        metrics["pg_token_kept_frac"] = _masked_mean(inputs.pg_keep_T, mask)
    if cfg.off_policy_mask_threshold is not None:
        keep_T = off_policy_keep_T(inputs, cfg.off_policy_mask_threshold)
        pg_T = pg_T * keep_T
        metrics["opsm_masked_frac"] = _masked_mean(1 - keep_T, mask)
    return pg_T, metrics


def actor_loss(inputs: PolicyInputs, cfg: ActorSection, denominator: float,
               host_metrics: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy, each aggregated with
    `cfg.loss_agg_mode` over the global `denominator`. Returns (loss share, metrics). `host_metrics=False`:
    the metrics stay device scalars (`metrics_to_floats` later), so the backward is queued without waiting."""
    inputs.check()
    def agg(values_T: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values_T, inputs.loss_mask_T, inputs.cu_seqlens, cfg.loss_agg_mode, denominator)

    pg_T, ratio_T = _policy_loss_T(inputs, cfg)
    pg_T, token_metrics = _weighted_and_masked(pg_T, inputs, cfg)
    pg_loss = agg(pg_T)
    loss, metrics = pg_loss, {"pg_loss": pg_loss.detach(), **_ratio_metrics(inputs, ratio_T, cfg), **token_metrics}
    if cfg.use_kl_loss:
        if inputs.ref_logprobs_T is None:
            raise ValueError("actor.use_kl_loss needs ref_logprobs_T")
        kl_T = kl_estimate(inputs.logprobs_T, inputs.ref_logprobs_T, cfg.kl_loss_type)
        kl_loss = agg(kl_T)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics.update(kl_loss=kl_loss.detach(), kl_mean=_masked_mean(kl_T, inputs.loss_mask_T))
    if cfg.entropy_coeff != 0 and inputs.entropy_T is None:
        raise ValueError("actor.entropy_coeff != 0 needs entropy_T")
    if inputs.entropy_T is not None:
        entropy_loss = agg(inputs.entropy_T)
        loss = loss - cfg.entropy_coeff * entropy_loss
        metrics.update(entropy_loss=entropy_loss.detach(), entropy=_masked_mean(inputs.entropy_T, inputs.loss_mask_T))
    return loss, metrics_to_floats(metrics) if host_metrics else metrics


def value_loss(
    values_T: torch.Tensor, old_values_T: torch.Tensor, returns_T: torch.Tensor, loss_mask_T: torch.Tensor,
    cu_seqlens: torch.Tensor, cfg: CriticSection, denominator: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss 0.5 * agg(max((v - R)^2, (clip(v, v_old +- cliprange_value) - R)^2)). Returns (loss share, metrics)."""
    clipped = old_values_T + (values_T - old_values_T).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    unclipped_T, clipped_T = (values_T - returns_T).square(), (clipped - returns_T).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_T, clipped_T), loss_mask_T, cu_seqlens, cfg.loss_agg_mode, denominator)
    return loss, metrics_to_floats({
        "vf_loss": loss.detach(),
        "vf_clipfrac": _masked_mean((clipped_T > unclipped_T).float(), loss_mask_T),
        "vpred_mean": _masked_mean(values_T, loss_mask_T),
        "num_loss_tokens": loss_mask_T.bool().sum(),
    })


def reduce_metrics(per_micro_batch: list[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch metrics: loss shares (SHARE_KEYS) are summed, the rest are
    token-weighted means (weights = num_loss_tokens); num_loss_tokens is summed."""
    total_tokens = sum(m.get("num_loss_tokens", 0.0) for m in per_micro_batch)
    out: dict[str, float] = {}
    for key in {k for m in per_micro_batch for k in m}:
        values = [(m[key], m.get("num_loss_tokens", 0.0)) for m in per_micro_batch if key in m]
        if key in SHARE_KEYS or key == "num_loss_tokens":
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / total_tokens if total_tokens else 0.0
    return out
