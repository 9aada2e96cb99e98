"""SwiGLU feed-forward `down(silu(gate(x)) * up(x))`: dense layers and DeepSeek's shared experts."""
# T tokens, D model dim, F ffn dim
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=bias)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=bias)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))
