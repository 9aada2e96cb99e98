"""DeepSeek-V3 multi-head latent attention (MLA), numerically as transformers' DeepseekV3Attention.

q: x -> q_a_proj -> q_a_layernorm -> q_b_proj (or q_proj when q_lora_rank is None) -> [nope | rope] per head.
kv: x -> kv_a_proj_with_mqa -> [latent C | shared rope key]; latent -> kv_a_layernorm -> kv_b_proj -> per-head
[k_nope | v]. The latent is expanded to full heads before `ctx.attend` (G = H), so any AttentionContext works;
the rope key is shared by all heads. The low-rank norms use eps=1e-6 as in transformers (not rms_norm_eps).
"""
# T tokens, D model dim, H heads, Dn nope dim, Dr rope dim, Dk = Dn + Dr, Dv value dim, C kv latent (kv_lora_rank)
from __future__ import annotations

import torch
from torch import nn

from moeloop.model.attention import AttentionContext
from moeloop.model.config import ModelConfig
from moeloop.model.norm import RMSNorm
from moeloop.model.rope import RopeTables, softmax_scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D, H, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        self.num_heads, self.kv_lora_rank = H, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Dk = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * Dk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * Dk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=bias)
        self.scale = softmax_scale(cfg)

    def _query(self, x_TD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_TD)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))

    def forward(self, x_TD: torch.Tensor, rope: RopeTables, ctx: AttentionContext) -> torch.Tensor:
        T, H = x_TD.shape[0], self.num_heads
        q_THDk = self._query(x_TD).view(T, H, -1)
        q_nope_THDn, q_rope_THDr = q_THDk.split([self.nope_dim, self.rope_dim], dim=-1)
        latent_TC, k_rope_TDr = self.kv_a_proj_with_mqa(x_TD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_THX = self.kv_b_proj(self.kv_a_layernorm(latent_TC)).view(T, H, self.nope_dim + self.v_dim)
        k_nope_THDn, v_THDv = kv_THX.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope_THDr = rope.rotate(q_rope_THDr)
        k_rope_T1Dr = rope.rotate(k_rope_TDr[:, None, :])
        q_THDk = torch.cat((q_nope_THDn, q_rope_THDr), dim=-1)
        k_THDk = torch.cat((k_nope_THDn, k_rope_T1Dr.expand(T, H, self.rope_dim)), dim=-1)
        o_THDv = ctx.attend(self.layer_idx, q_THDk, k_THDk, v_THDv.contiguous(), self.scale)
        return self.o_proj(o_THDv.reshape(T, -1))
