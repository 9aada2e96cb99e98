"""Grouped-query self-attention (Llama / Qwen / Mixtral), optional per-head q/k RMSNorm (Qwen3).

Projects, normalises and rotates q/k, then hands [T, H, D] / [T, G, D] tensors to the `AttentionContext`
(packed training attention or the rollout engine's paged KV); GQA heads are never expanded here.
"""
# T tokens, D model dim, H query heads, G kv heads, Dh head dim
from __future__ import annotations

import torch
from torch import nn

from moeloop.model.attention import AttentionContext
from moeloop.model.config import ModelConfig
from moeloop.model.norm import RMSNorm
from moeloop.model.rope import RopeTables, softmax_scale


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        D, H, G, Dh, bias = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(D, H * Dh, bias=bias)
        self.k_proj = nn.Linear(D, G * Dh, bias=bias)
        self.v_proj = nn.Linear(D, G * Dh, bias=bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=bias and cfg.model_type != "qwen2")  # Qwen2: q/k/v bias only
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.scale = softmax_scale(cfg)

    def forward(self, x_TD: torch.Tensor, rope: RopeTables, ctx: AttentionContext) -> torch.Tensor:
        T = x_TD.shape[0]
        q_THD = self.q_proj(x_TD).view(T, self.num_heads, self.head_dim)
        k_TGD = self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        v_TGD = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q_THD, k_TGD = self.q_norm(q_THD), self.k_norm(k_TGD)
        q_THD, k_TGD = rope.rotate(q_THD), rope.rotate(k_TGD)
        o_THD = ctx.attend(self.layer_idx, q_THD, k_TGD, v_TGD, self.scale)
        return self.o_proj(o_THD.reshape(T, -1))
