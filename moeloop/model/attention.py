"""How attention layers reach keys and values: an `AttentionContext` passed through the forward.

The model never owns a KV cache. Training and teacher-forced logprobs pass a `PackedAttention`
(one flat token stream, causal inside each sequence, no padding), or a `GatheredAttention` when the
forward runs on fewer rows (a shared prompt once); the rollout engine passes its own
context that writes K/V into paged blocks and attends over them. Same layer code for both.

Shapes: T tokens in the flat stream (U <= T rows computed under GatheredAttention), H query heads, G key/value heads (H % G == 0),
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
    """Causal attention inside each sequence of a packed stream; `cu_seqlens` = [0, n0, n0+n1, ...].

    Sequences of similar length (padding at most doubles the tokens) run as ONE batched SDPA call on a
    right-padded [S, H, L, D] view: with a causal mask a real query never sees a padded key, and
    padded query rows are dropped, so no mask tensor is needed and flash kernels apply. Otherwise each
    sequence gets its own call. Both give the same numbers.
    """

    MAX_PAD_FACTOR = 2.0

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self.bounds = [int(x) for x in cu_seqlens.tolist()]
        self.lengths = [e - s for s, e in zip(self.bounds[:-1], self.bounds[1:])]
        self.max_len = max(self.lengths, default=0)
        total = self.bounds[-1] if self.bounds else 0
        self.batched = len(self.lengths) > 1 and len(self.lengths) * self.max_len <= self.MAX_PAD_FACTOR * total
        self._slots: torch.Tensor | None = None

    def _padded_slots(self, device: torch.device) -> torch.Tensor:
        """Row of each packed token in the flattened [S * L] padded layout."""
        if self._slots is None or self._slots.device != device:
            self._slots = torch.cat([torch.arange(n) + i * self.max_len for i, n in enumerate(self.lengths)]).to(device)
        return self._slots

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        gqa = k_TGD.shape[1] != q_THD.shape[1]
        if self.batched:
            return self._attend_padded(q_THD, k_TGD, v_TGDv, scale, gqa)
        outs = []
        for start, end in zip(self.bounds[:-1], self.bounds[1:]):
            # 4-D [1, H, S, D]: 3-D inputs make SDPA take its math kernel (materialised [H, S, S] scores)
            q = q_THD[start:end].transpose(0, 1)[None]
            k = k_TGD[start:end].transpose(0, 1)[None]
            v = v_TGDv[start:end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, 0)

    def _attend_padded(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor, scale: float,
                       gqa: bool) -> torch.Tensor:
        slots = self._padded_slots(q_THD.device)
        S, L = len(self.lengths), self.max_len

        def pad(x_TXD: torch.Tensor) -> torch.Tensor:  # [T, X, D] -> [S, X, L, D]
            out = x_TXD.new_zeros(S * L, *x_TXD.shape[1:]).index_copy(0, slots, x_TXD)
            return out.view(S, L, *x_TXD.shape[1:]).transpose(1, 2)

        o_SHLD = F.scaled_dot_product_attention(pad(q_THD), pad(k_TGD), pad(v_TGDv), is_causal=True, scale=scale,
                                                enable_gqa=gqa)
        return o_SHLD.transpose(1, 2).reshape(S * L, *o_SHLD.shape[1:2], o_SHLD.shape[-1]).index_select(0, slots)


class GatheredAttention:
    """`PackedAttention` for a forward over U stream rows (a shared prompt once): q/k/v rows are gathered into
    the packed layout (`gather_T`, every sequence whole), attended there, and stream row u takes the output
    at packed position `owner_U[u]`. Gradients of a shared k/v row sum over its copies."""

    def __init__(self, cu_seqlens: torch.Tensor, gather_T: torch.Tensor, owner_U: torch.Tensor):
        self.packed, self.gather_T, self.owner_U = PackedAttention(cu_seqlens), gather_T, owner_U

    def attend(self, layer_idx: int, q_UHD: torch.Tensor, k_UGD: torch.Tensor, v_UGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        g = self.gather_T  # index_select: its backward is index_add, no accumulate-index_put
        o_THDv = self.packed.attend(layer_idx, q_UHD.index_select(0, g), k_UGD.index_select(0, g),
                                    v_UGDv.index_select(0, g), scale)
        return o_THDv.index_select(0, self.owner_U)
