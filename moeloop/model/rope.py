"""Rotary position embeddings for a packed token stream: inverse frequencies (default, linear, llama3, yarn),
the cos/sin tables for given position ids, the two rotation layouts (half-split, on CUDA one Triton kernel each
way from rope_kernel.py, and DeepSeek-V3's interleaved pairs), and the YaRN softmax-scale correction of DeepSeek
MLA. Numerics follow transformers.
"""
# T tokens, H heads, R rotary dim (even), R2 = R // 2 frequencies
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from moeloop.model.config import ModelConfig
from moeloop.model.rope_kernel import rope_half_split_kernel, rope_kernel_applies


@dataclass
class RopeTables:
    """cos/sin for the tokens of one forward; `rotate` applies them to the last R dims of a [T, H, R] tensor."""

    cos_TR: torch.Tensor
    sin_TR: torch.Tensor
    interleaved: bool

    def rotate(self, x_THR: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return _rotate_interleaved(x_THR, self.cos_TR, self.sin_TR)
        if rope_kernel_applies(x_THR, self.cos_TR, self.sin_TR):
            return rope_half_split_kernel(x_THR, self.cos_TR, self.sin_TR)  # same values, one kernel each way
        return _rotate_half_split(x_THR, self.cos_TR, self.sin_TR)


def _rotate_half_split(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_THR.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_THR * cos_TR[:, None] + rotated * sin_TR[:, None]


def _rotate_interleaved(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    # pairs (x0, x1), (x2, x3), ... share one frequency; the output is de-interleaved [evens', odds'] as in
    # transformers' apply_rotary_pos_emb_interleave (q and k get the same permutation, so q.k is unchanged)
    half = cos_TR.shape[-1] // 2
    cos, sin = cos_TR[:, None, :half], sin_TR[:, None, :half]
    x1, x2 = x_THR[..., 0::2], x_THR[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding:
    """Frequencies computed once in fp32 on the host and kept out of the state dict: no buffer for `.to(bf16)` to
    round, and nothing lost when the model is built on the meta device."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq_R2, self.attention_factor = rope_inv_freq(cfg)
        self.interleaved = cfg.model_type == "deepseek_v3" and bool(cfg.hf_config.get("rope_interleave", True))
        self._table: dict[tuple, RopeTables] = {}  # `table`'s cache

    def tables(self, position_ids_T: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        inv_freq = self.inv_freq_R2.to(position_ids_T.device)
        freqs_TR2 = position_ids_T[:, None].float() * inv_freq
        emb_TR = torch.cat((freqs_TR2, freqs_TR2), dim=-1)
        cos = (emb_TR.cos() * self.attention_factor).to(dtype)
        sin = (emb_TR.sin() * self.attention_factor).to(dtype)
        return RopeTables(cos, sin, self.interleaved)

    def table(self, num_positions: int, dtype: torch.dtype, device: torch.device) -> RopeTables:
        """`tables` of positions 0 .. P-1 (P >= num_positions), computed once per dtype and device and kept: row p
        holds the same values `tables` gives position p (elementwise ops), so a decode step can index it instead of
        recomputing (the rollout's fused decode: about nine small kernels per step fewer). It cannot grow while a
        CUDA graph is being captured (the warm-up run before a capture builds it)."""
        key = (dtype, torch.device(device))
        cached = self._table.get(key)
        if cached is None or cached.cos_TR.shape[0] < num_positions:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"RotaryEmbedding.table({num_positions}) must be built before CUDA graph capture")
            size = 1 << max(num_positions - 1, 1).bit_length()  # powers of two: few rebuilds as lengths grow
            cached = self._table[key] = self.tables(torch.arange(size, device=device), dtype)
        return cached


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin scale ("attention_factor") for `cfg.rope_scaling`."""
    dim, base, params = cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, dim, base, params)
    raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported (default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: ModelConfig, dim: int, base: float, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig_max = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor") or cfg.max_position_embeddings / orig_max
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim); DeepSeek MLA with YaRN multiplies it by mscale(factor, mscale_all_dim)**2."""
    scale = cfg.qk_head_dim ** -0.5
    p = cfg.rope_scaling
    if cfg.model_type == "deepseek_v3" and p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        mscale = _yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale
