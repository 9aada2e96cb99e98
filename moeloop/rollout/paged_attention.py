"""`PagedAttention`: the rollout engine's `AttentionContext` over the paged `KVCache`.

Each layer call first writes this forward's k/v into their slots (`slot_mapping`), then attends every
query over its own sequence's cached K/V, causally: query j of a chunk of q_len tokens ending at
context length L sees positions < L - q_len + j + 1. The flat stream mixes decode rows (q_len 1) and
prefill chunks. Decode rows run batched: the Triton kernel when `use_kernel` (CUDA), else gather +
SDPA over the padded batch. Prefill chunks that are whole sequences (no cached prefix) run together as one
packed causal attention; chunks that continue a cached prefix (a multi-turn sample's next turn, a prefix-cache hit,
a long prompt's later chunk) run together as one SDPA over their contexts gathered from the cache (`CachedPrefills`),
or, when their sizes are too far apart to pad, one SDPA each.
Shapes: T tokens, B decode rows, H/G query/kv heads, Dk/Dv head dims, L context, N blocks per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeloop.model.attention import PackedAttention, cu_seqlens_from_lengths
from moeloop.model.routes import SlotRoutes
from moeloop.rollout.decode_kernel import paged_decode_attention
from moeloop.rollout.kv_cache import KVCache
from moeloop.transfer import to_device, upload


@dataclass
class PrefillChunk:
    start: int  # first query row in the flat stream
    q_len: int
    ctx_len: int
    table: list[int] | None = None  # its block table when it continues a cached prefix (ctx_len > q_len), else None


@dataclass
class AttentionMetadata:
    slot_mapping_T: torch.Tensor  # int64
    decode_rows_B: torch.Tensor | None  # rows of the decode queries in the stream; None = all rows (decode-only)
    block_tables_BN: torch.Tensor  # int32, decode rows
    context_lens_B: torch.Tensor  # int32, decode rows
    max_decode_len: int  # host-side max of context_lens_B (the gather path pads to it)
    prefills: list[PrefillChunk]

    @property
    def num_decode(self) -> int:
        return self.context_lens_B.shape[0]


def slots_of(block_table_N: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table_N[positions // block_size].long() * block_size + positions % block_size


class PagedAttention:
    def __init__(self, cache: KVCache, meta: AttentionMetadata, use_kernel: bool = False):
        self.cache, self.meta, self.use_kernel = cache, meta, use_kernel
        # rollout.record_routes: the MoE blocks write their experts at this forward's slots (router replay R3)
        self.routes = None if cache.routes is None else SlotRoutes(cache.routes, meta.slot_mapping_T)
        self._gather: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh = _fresh_prefills(meta)
        cached = [c for c in meta.prefills if c.table is not None]
        self._cached = CachedPrefills(cached, cache.block_size, meta.slot_mapping_T.device) \
            if CachedPrefills.fits(cached) else None
        self._slots: dict[int, torch.Tensor] = {}  # a cached chunk's context slots, by its start row

    def attend(self, layer_idx: int, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        meta = self.meta
        k_cache.index_copy_(0, meta.slot_mapping_T, k_TGD.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping_T, v_TGDv.to(v_cache.dtype))
        if meta.decode_rows_B is None and not meta.prefills:
            return self._decode(q_THD, k_cache, v_cache, scale)
        fresh = self._fresh
        if fresh is not None and fresh[0] is None:  # the stream is nothing but whole prompts: no row gather/scatter
            return fresh[1].attend(layer_idx, q_THD, k_TGD, v_TGDv, scale)
        out = q_THD.new_empty(q_THD.shape[0], q_THD.shape[1], v_TGDv.shape[-1])
        if meta.num_decode:
            out[meta.decode_rows_B] = self._decode(q_THD[meta.decode_rows_B], k_cache, v_cache, scale)
        if fresh is not None:  # whole prompts with no cached prefix: one packed causal attention for all of them
            rows, packed = fresh
            out[rows] = packed.attend(layer_idx, q_THD[rows], k_TGD[rows], v_TGDv[rows], scale)
        if self._cached is not None:
            self._cached.attend(out, q_THD, k_cache, v_cache, scale)
        for chunk in meta.prefills:
            if (fresh is not None and chunk.table is None) or (self._cached is not None and chunk.table is not None):
                continue
            rows = slice(chunk.start, chunk.start + chunk.q_len)
            out[rows] = self._prefill(chunk, q_THD[rows], k_TGD[rows], v_TGDv[rows], k_cache, v_cache, scale)
        return out

    def attend_cached(self, layer_idx: int, q_BHD: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode-only batch whose K/V are already in the cache (the fused decode forward writes them)."""
        return self._decode(q_BHD, self.cache.k[layer_idx], self.cache.v[layer_idx], scale)

    def _decode(self, q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        meta = self.meta
        if self.use_kernel:
            return paged_decode_attention(q_BHD.contiguous(), k_cache, v_cache, meta.block_tables_BN,
                                          meta.context_lens_B, self.cache.block_size, scale).to(q_BHD.dtype)
        slots_S, bias_B11L = self._gather_index(q_BHD.dtype)  # index_select on flat slots: ~4x cheaper than k_cache[slots_BL]
        B, L = bias_B11L.shape[0], bias_B11L.shape[-1]
        k_BGLD = k_cache.index_select(0, slots_S).view(B, L, *k_cache.shape[1:]).transpose(1, 2).to(q_BHD.dtype)
        v_BGLD = v_cache.index_select(0, slots_S).view(B, L, *v_cache.shape[1:]).transpose(1, 2).to(q_BHD.dtype)
        o_BH1D = F.scaled_dot_product_attention(q_BHD[:, :, None], k_BGLD, v_BGLD, attn_mask=bias_B11L,
                                                scale=scale, enable_gqa=k_BGLD.shape[1] != q_BHD.shape[1])
        return o_BH1D[:, :, 0]

    def _gather_index(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of every decode row's context (padded to Lmax, flattened [B * Lmax]) and the additive mask [B, 1, 1,
        Lmax] (0 / -inf: what SDPA would make of the boolean mask in every layer); built once per forward."""
        if self._gather is None:
            meta, bs = self.meta, self.cache.block_size
            pos_L = torch.arange(meta.max_decode_len, device=meta.block_tables_BN.device)
            blocks_BL = meta.block_tables_BN.long().gather(1, (pos_L // bs)[None].expand(meta.num_decode, -1))
            mask_BL = pos_L[None] < meta.context_lens_B[:, None]
            slots_BL = torch.where(mask_BL, blocks_BL * bs + pos_L % bs, 0)
            bias_BL = torch.zeros(mask_BL.shape, dtype=dtype, device=mask_BL.device).masked_fill_(~mask_BL, float("-inf"))
            self._gather = slots_BL.view(-1), bias_BL[:, None, None]
        return self._gather

    def _prefill(self, chunk: PrefillChunk, q_QHD: torch.Tensor, k_QGD: torch.Tensor, v_QGD: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        q_HQD = q_QHD.transpose(0, 1)
        if chunk.table is None:  # whole sequence in this chunk: its own k/v are the context
            k_GLD, v_GLD, mask, causal = k_QGD.transpose(0, 1), v_QGD.transpose(0, 1), None, True
        else:
            if chunk.start not in self._slots:
                self._slots[chunk.start] = upload(context_slots(chunk, self.cache.block_size), q_QHD.device)
            slots_L = self._slots[chunk.start]
            k_GLD = k_cache[slots_L].transpose(0, 1).to(q_QHD.dtype)
            v_GLD = v_cache[slots_L].transpose(0, 1).to(q_QHD.dtype)
            offset = chunk.ctx_len - chunk.q_len
            pos_L = torch.arange(chunk.ctx_len, device=q_QHD.device)
            mask = pos_L[None, :] <= (offset + torch.arange(chunk.q_len, device=q_QHD.device))[:, None]
            causal = False
        o_HQD = F.scaled_dot_product_attention(q_HQD, k_GLD, v_GLD, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=k_GLD.shape[0] != q_HQD.shape[0])
        return o_HQD.transpose(0, 1)


def context_slots(chunk: PrefillChunk, block_size: int) -> torch.Tensor:
    """The cache slots of a cached chunk's positions [0, ctx_len), on the host."""
    return slots_of(torch.tensor(chunk.table), torch.arange(chunk.ctx_len), block_size)


class CachedPrefills:
    """The prefill chunks that continue a cached prefix, as one SDPA: queries padded to the longest chunk (Q), their
    contexts gathered from the cache padded to the longest context (L), and an additive mask [S, 1, Q, L] that lets
    query j of a chunk at offset o see positions <= o + j (a padded query row repeats the chunk's last query; its
    output is dropped). Index tensors are built once per forward, in one upload each."""

    MAX_PAD_FACTOR = 2.0

    @classmethod
    def fits(cls, chunks: list[PrefillChunk]) -> bool:
        """Several chunks whose padding at most doubles the queries and the context reads."""
        if len(chunks) < 2:
            return False
        q_max, l_max = max(c.q_len for c in chunks), max(c.ctx_len for c in chunks)
        return (len(chunks) * q_max <= cls.MAX_PAD_FACTOR * sum(c.q_len for c in chunks)
                and len(chunks) * l_max <= cls.MAX_PAD_FACTOR * sum(c.ctx_len for c in chunks))

    def __init__(self, chunks: list[PrefillChunk], block_size: int, device: torch.device):
        self.S, self.Q, self.L = len(chunks), max(c.q_len for c in chunks), max(c.ctx_len for c in chunks)
        q_rows, k_slots, out_rows, padded = [], [], [], []
        for i, c in enumerate(chunks):
            q_rows += [c.start + min(j, c.q_len - 1) for j in range(self.Q)]
            slots = context_slots(c, block_size)
            k_slots += [slots, slots[:1].expand(self.L - c.ctx_len)]  # (finite values the mask hides)
            out_rows += range(c.start, c.start + c.q_len)
            padded += range(i * self.Q, i * self.Q + c.q_len)
        self.q_rows, self.k_slots = to_device(q_rows, device), upload(torch.cat(k_slots), device)
        self.out_rows, self.padded = to_device(out_rows, device), to_device(padded, device)
        self.ends = to_device([[c.ctx_len - c.q_len, c.q_len] for c in chunks], device)  # offset, q_len
        self._bias: torch.Tensor | None = None

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        if self._bias is None:
            device = self.ends.device
            j_Q = torch.arange(self.Q, device=device)
            last_SQ = self.ends[:, :1] + torch.minimum(j_Q[None], self.ends[:, 1:] - 1)  # each query's own position
            seen_SQL = torch.arange(self.L, device=device)[None, None] <= last_SQ[:, :, None]
            self._bias = torch.zeros(seen_SQL.shape, dtype=dtype, device=device).masked_fill_(~seen_SQL, float("-inf"))
        return self._bias[:, None]

    def attend(self, out_THDv: torch.Tensor, q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> None:
        """Write the chunks' attention outputs into their rows of `out_THDv`."""
        S, Q, L = self.S, self.Q, self.L
        q_SHQD = q_THD.index_select(0, self.q_rows).view(S, Q, *q_THD.shape[1:]).transpose(1, 2)
        k_SGLD = k_cache.index_select(0, self.k_slots).view(S, L, *k_cache.shape[1:]).transpose(1, 2).to(q_THD.dtype)
        v_SGLD = v_cache.index_select(0, self.k_slots).view(S, L, *v_cache.shape[1:]).transpose(1, 2).to(q_THD.dtype)
        o_SHQD = F.scaled_dot_product_attention(q_SHQD, k_SGLD, v_SGLD, attn_mask=self.bias(q_THD.dtype), scale=scale,
                                                enable_gqa=k_SGLD.shape[1] != q_SHQD.shape[1])
        o_PHD = o_SHQD.transpose(1, 2).reshape(S * Q, *o_SHQD.shape[1:2], o_SHQD.shape[-1])
        out_THDv[self.out_rows] = o_PHD.index_select(0, self.padded)


def _fresh_prefills(meta: AttentionMetadata) -> tuple[torch.Tensor | None, PackedAttention] | None:
    """(stream rows, packed attention) of the prefill chunks that are whole sequences, when there are several;
    rows None when those chunks are the whole stream (then in stream order: the attention takes it as is)."""
    chunks = [c for c in meta.prefills if c.table is None]
    if len(chunks) < 2:
        return None
    device = meta.slot_mapping_T.device
    packed = PackedAttention(cu_seqlens_from_lengths([c.q_len for c in chunks], device))
    if meta.num_decode == 0 and len(chunks) == len(meta.prefills):
        return None, packed
    return to_device([r for c in chunks for r in range(c.start, c.start + c.q_len)], device), packed
