"""How attention layers reach keys and values: an `AttentionContext` passed through the forward.

The model never owns a KV cache. Training and teacher-forced logprobs pass a `PackedAttention`
(one flat token stream, causal inside each sequence, no padding); the rollout engine passes its own
context that writes K/V into paged blocks and attends over them. Same layer code for both.

Shapes: T tokens in the flat stream, H query heads, G key/value heads (H % G == 0),
Dk query/key head dim, Dv value head dim (MLA has Dk != Dv).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Return attention output [T, H, Dv] for the T query tokens of this forward."""
        ...


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    lengths_t = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return F.pad(torch.cumsum(lengths_t, 0, dtype=torch.int32), (1, 0))


def position_ids_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)


class PackedAttention:
    """Causal attention inside each sequence of a packed stream; `cu_seqlens` = [0, n0, n0+n1, ...]."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self.bounds = [int(x) for x in cu_seqlens.tolist()]

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        outs = []
        for start, end in zip(self.bounds[:-1], self.bounds[1:]):
            # 4-D [1, H, S, D]: 3-D inputs make SDPA take its math kernel (materialised [H, S, S] scores)
            q = q_THD[start:end].transpose(0, 1)[None]
            k = k_TGD[start:end].transpose(0, 1)[None]
            v = v_TGDv[start:end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, 0)
