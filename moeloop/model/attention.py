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


class RowMap:
    """Where the rows of a gathered tensor come from: out row p = in row `src_P[p]`. Rows that several out rows
    read get their gradient summed over them, as `index_select`'s would, but without atomics over every row:
    each in row u takes the out row `primary_U[u]`, and the few other readers (`extra_src` -> `extra_dst`) are
    added after. Out rows that are neither (`src_P` pads) pass no gradient: the caller guarantees theirs is 0."""

    def __init__(self, src_P: torch.Tensor, primary_U: torch.Tensor, extra_src: torch.Tensor, extra_dst: torch.Tensor):
        self.src_P, self.primary_U, self.extra_src, self.extra_dst = src_P, primary_U, extra_src, extra_dst

    @classmethod
    def of_gather(cls, gather_P: torch.Tensor, primary_U: torch.Tensor, readers_P: torch.Tensor | None = None,
                  num_out: int | None = None) -> "RowMap":
        """Out row `readers_P[t]` (default t) reads in row `gather_P[t]`; in row u's primary reader is out row
        `primary_U[u]` (one of its readers). Out rows that no t names (`num_out` > len: pads) read row 0."""
        readers_P = torch.arange(len(gather_P), device=gather_P.device) if readers_P is None else readers_P
        src_P = gather_P if num_out is None else gather_P.new_zeros(num_out).index_copy_(0, readers_P, gather_P)
        extra = primary_U[gather_P] != readers_P  # one host sync, once per forward
        return cls(src_P, primary_U, readers_P[extra], gather_P[extra])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_UX: torch.Tensor, rows: RowMap) -> torch.Tensor:
        ctx.rows = rows
        return x_UX.index_select(0, rows.src_P)

    @staticmethod
    def backward(ctx, g_PX: torch.Tensor):
        rows = ctx.rows
        g_UX = g_PX.index_select(0, rows.primary_U)
        if len(rows.extra_src):
            g_UX.index_add_(0, rows.extra_dst, g_PX.index_select(0, rows.extra_src))
        return g_UX, None


class _TakeRows(torch.autograd.Function):
    """out = x[idx] for distinct `idx`: the backward is a plain scatter into zeros (no accumulation)."""

    @staticmethod
    def forward(ctx, x_PX: torch.Tensor, idx_U: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx_U)
        ctx.num_rows = x_PX.shape[0]
        return x_PX.index_select(0, idx_U)

    @staticmethod
    def backward(ctx, g_UX: torch.Tensor):
        (idx_U,) = ctx.saved_tensors
        return g_UX.new_zeros(ctx.num_rows, *g_UX.shape[1:]).index_copy_(0, idx_U, g_UX), None


def gather_rows(x_UX: torch.Tensor, rows: RowMap) -> torch.Tensor:
    """x_UX[rows.src_P], with `RowMap`'s backward (exact; atomics only for rows read more than once)."""
    return _GatherRows.apply(x_UX, rows)


def take_rows(x_PX: torch.Tensor, idx_U: torch.Tensor) -> torch.Tensor:
    """x_PX[idx_U] for distinct indices (no accumulating backward)."""
    return _TakeRows.apply(x_PX, idx_U)


class PackedAttention:
    """Causal attention inside each sequence of a packed stream; `cu_seqlens` = [0, n0, n0+n1, ...].

    Sequences of similar length (padding at most doubles the tokens) run as ONE batched SDPA call on a
    right-padded [S, H, L, D] view: with a causal mask a real query never sees a padded key, and padded query
    rows are dropped, so the pads may hold any finite values (copies of row 0: one gather, no zero fill), they
    pass no gradient, no mask tensor is needed and flash kernels apply. Otherwise each sequence gets its own
    call. Both give the same numbers.
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
        self._pad_rows: RowMap | None = None

    def padded_slots(self, device: torch.device) -> torch.Tensor:
        """Row of each packed token in the flattened [S * L] padded layout."""
        if self._slots is None or self._slots.device != device:
            self._slots = torch.cat([torch.arange(n) + i * self.max_len for i, n in enumerate(self.lengths)]).to(device)
        return self._slots

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        if self.batched:
            if self._pad_rows is None or self._pad_rows.src_P.device != q_THD.device:
                slots = self.padded_slots(q_THD.device)  # every token read once: no extra readers, no host sync
                src_P = slots.new_zeros(len(self.lengths) * self.max_len).index_copy_(
                    0, slots, torch.arange(len(slots), device=slots.device))
                none = slots[:0]
                self._pad_rows = RowMap(src_P, slots, none, none)
            return self.attend_padded(q_THD, k_TGD, v_TGDv, scale, self._pad_rows, self._slots)
        outs = []
        for start, end in zip(self.bounds[:-1], self.bounds[1:]):
            # 4-D [1, H, S, D]: 3-D inputs make SDPA take its math kernel (materialised [H, S, S] scores)
            q = q_THD[start:end].transpose(0, 1)[None]
            k = k_TGD[start:end].transpose(0, 1)[None]
            v = v_TGDv[start:end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=k_TGD.shape[1] != q_THD.shape[1])
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, 0)

    def attend_padded(self, q_UHD: torch.Tensor, k_UGD: torch.Tensor, v_UGDv: torch.Tensor, scale: float,
                      rows: RowMap, out_U: torch.Tensor) -> torch.Tensor:
        """The batched call on input rows gathered into the padded layout by `rows`; output row u is padded row
        `out_U[u]`."""
        S, L = len(self.lengths), self.max_len

        def pad(x_UXD: torch.Tensor) -> torch.Tensor:  # [U, X, D] -> [S, X, L, D]
            return gather_rows(x_UXD, rows).view(S, L, *x_UXD.shape[1:]).transpose(1, 2)

        o_SHLD = F.scaled_dot_product_attention(pad(q_UHD), pad(k_UGD), pad(v_UGDv), is_causal=True, scale=scale,
                                                enable_gqa=k_UGD.shape[1] != q_UHD.shape[1])
        return take_rows(o_SHLD.transpose(1, 2).reshape(S * L, *o_SHLD.shape[1:2], o_SHLD.shape[-1]), out_U)


class GatheredAttention:
    """`PackedAttention` for a forward over U stream rows (a shared prompt once): q/k/v rows are gathered into
    the packed layout (`gather_T`, every sequence whole), attended there, and stream row u takes the output
    at packed position `owner_U[u]`. Gradients of a shared k/v row sum over its copies. In the batched case the
    gather goes straight into the padded layout (one gather per tensor; see `RowMap`)."""

    def __init__(self, cu_seqlens: torch.Tensor, gather_T: torch.Tensor, owner_U: torch.Tensor):
        self.packed, self.gather_T, self.owner_U = PackedAttention(cu_seqlens), gather_T, owner_U
        self._pad_rows: RowMap | None = None
        self._out_U: torch.Tensor | None = None

    def attend(self, layer_idx: int, q_UHD: torch.Tensor, k_UGD: torch.Tensor, v_UGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        packed = self.packed
        if packed.batched:
            if self._pad_rows is None or self._pad_rows.src_P.device != q_UHD.device:
                slots_T = packed.padded_slots(q_UHD.device)
                self._out_U = slots_T[self.owner_U.to(q_UHD.device)]
                self._pad_rows = RowMap.of_gather(self.gather_T.to(q_UHD.device), self._out_U, slots_T,
                                                  len(packed.lengths) * packed.max_len)
            return packed.attend_padded(q_UHD, k_UGD, v_UGDv, scale, self._pad_rows, self._out_U)
        g = self.gather_T  # index_select: its backward is index_add, no accumulate-index_put
        o_THDv = packed.attend(layer_idx, q_UHD.index_select(0, g), k_UGD.index_select(0, g),
                               v_UGDv.index_select(0, g), scale)
        return o_THDv.index_select(0, self.owner_U)
