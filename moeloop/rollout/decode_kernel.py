"""Triton paged-attention decode kernel: one query token per sequence attends over its cached K/V blocks.

One program per (sequence, kv head) computes all H/G query heads of that group with an online softmax
over `BLOCK_N` keys at a time, reading K/V straight from the paged cache through the block table (no
gather copy, static shapes, so it can live inside a CUDA graph). Tested on CPU with TRITON_INTERPRET=1.
Shapes: B sequences, H query heads, G kv heads, Dk/Dv head dims, N max blocks per sequence.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch ships without triton
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, scale,
                      s_qb, s_qh, s_ks, s_kg, s_vs, s_vg, s_ob, s_oh, s_tb,
                      QH: tl.constexpr, QH_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                      DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        ctx_len = tl.load(lens_ptr + b)
        h = tl.arange(0, QH_PAD)
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        h_ok = h < QH
        q = tl.load(q_ptr + b * s_qb + (g * QH + h)[:, None] * s_qh + dk[None, :],
                    mask=h_ok[:, None] & (dk[None, :] < DK), other=0.0)
        m_i = tl.full([QH_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([QH_PAD], tl.float32)
        acc = tl.zeros([QH_PAD, DV_PAD], tl.float32)
        for start in range(0, ctx_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_ok = pos < ctx_len
            blk = tl.load(tables_ptr + b * s_tb + pos // BLOCK_SIZE, mask=p_ok, other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            k = tl.load(k_ptr + slot[:, None] * s_ks + g * s_kg + dk[None, :],
                        mask=p_ok[:, None] & (dk[None, :] < DK), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(p_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + slot[:, None] * s_vs + g * s_vg + dv[None, :],
                        mask=p_ok[:, None] & (dv[None, :] < DV), other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * s_ob + (g * QH + h)[:, None] * s_oh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & (dv[None, :] < DV))


def paged_decode_attention(q_BHD: torch.Tensor, k_cache_SGD: torch.Tensor, v_cache_SGDv: torch.Tensor,
                           block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor, block_size: int,
                           scale: float, block_n: int = 64) -> torch.Tensor:
    """Attention of each row's single query over its first context_lens_B[b] cached positions -> [B, H, Dv]."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    B, H, Dk = q_BHD.shape
    G, Dv = k_cache_SGD.shape[1], v_cache_SGDv.shape[2]
    out = q_BHD.new_empty(B, H, Dv)
    qh = H // G
    block_n = max(16, min(block_n, triton.next_power_of_2(block_size) * 8))
    precision = "ieee" if q_BHD.dtype == torch.float32 else "tf32"
    _paged_decode[(B, G)](
        q_BHD, k_cache_SGD, v_cache_SGDv, out, block_tables_BN, context_lens_B, scale,
        q_BHD.stride(0), q_BHD.stride(1), k_cache_SGD.stride(0), k_cache_SGD.stride(1),
        v_cache_SGDv.stride(0), v_cache_SGDv.stride(1), out.stride(0), out.stride(1), block_tables_BN.stride(0),
        QH=qh, QH_PAD=max(16, triton.next_power_of_2(qh)), DK=Dk, DK_PAD=max(16, triton.next_power_of_2(Dk)),
        DV=Dv, DV_PAD=max(16, triton.next_power_of_2(Dv)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION=precision, num_warps=4)
    return out
