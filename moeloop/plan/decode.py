"""Decode roofline of a rollout share: tokens/s a set of engines can reach when HBM bandwidth is the limit.

One decode step of a batch of B sequences reads the weights the batch touches once (dense weights plus the
experts its B*k routing draws hit: E * (1 - (1 - k/E)^B) per MoE layer) and every sequence's KV cache.
B is capped by KV memory: what the engine's memory fraction leaves after its weights. MLA latents are
replicated across the engine's TP ranks (no head dim to split); GQA KV heads split over min(tp, kv heads).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moeloop.plan.accounting import ModelStats

GB = 1e9
BF16 = 2


def decode_tokens_per_s(weight_bytes_read: float, hbm_gbps: float, batch: int = 1,
                        kv_bytes_per_seq: float = 0.0, efficiency: float = 1.0) -> float:
    """Roofline tokens/s of one GPU (or one engine, with its summed bandwidth): batch / (bytes read / bandwidth)."""
    step_s = (weight_bytes_read + batch * kv_bytes_per_seq) / (hbm_gbps * GB * efficiency)
    return batch / step_s


def touched_expert_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """Expected fraction of one layer's experts hit by `batch` tokens choosing top_k each, uniform routing."""
    if not num_experts:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** batch


@dataclass(frozen=True)
class DecodeEstimate:
    gpus: int
    engine_tp: int
    engines: int
    batch: int  # concurrent sequences per engine (KV-limited, at most rollout.max_num_seqs)
    kv_bytes_per_seq: float  # per GPU, at the average decode context
    tokens_per_s_batch1: float  # whole share, one sequence per engine (the seed-002 bound)
    tokens_per_s: float  # whole share, at `batch`

    def to_dict(self) -> dict:
        return asdict(self)


def decode_roofline(stats: ModelStats, gpus: int, engine_tp: int, hbm_gbps: float, gpu_memory_gb: float,
                    memory_fraction: float, context_tokens: int, max_num_seqs: int, efficiency: float) -> DecodeEstimate:
    """Tokens/s of `gpus` GPUs run as engines of `engine_tp` GPUs each (bf16 weights and KV)."""
    engines = gpus // engine_tp
    weights_gpu = BF16 * stats.total_params / engine_tp
    active_gpu = BF16 * stats.active_params / engine_tp
    kv_seq = _kv_per_gpu_per_token(stats, engine_tp) * context_tokens
    free = memory_fraction * gpu_memory_gb * GB - weights_gpu
    batch = 1
    if kv_seq > 0 and free > 0:
        batch = max(1, min(max_num_seqs, int(free // kv_seq)))
    bw = hbm_gbps * efficiency
    one = decode_tokens_per_s(active_gpu + kv_seq, bw)
    many = decode_tokens_per_s(_weights_read(stats, batch) / engine_tp, bw, batch, kv_seq)
    return DecodeEstimate(gpus, engine_tp, engines, batch, kv_seq, engines * one, engines * many)


def _weights_read(stats: ModelStats, batch: int) -> float:
    m = stats.model
    if m is None or not m.num_experts:
        return BF16 * stats.active_params
    frac = touched_expert_fraction(m.num_experts, m.num_experts_per_tok, batch)
    return BF16 * (stats.dense_params + frac * stats.expert_params)


def _kv_per_gpu_per_token(stats: ModelStats, engine_tp: int) -> float:
    m = stats.model
    if m is None:
        return 0.0
    if m.is_mla:
        return stats.kv_bytes_per_token()
    return stats.kv_bytes_per_token() / math.gcd(engine_tp, m.num_kv_heads)
