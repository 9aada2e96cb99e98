"""Triton paged-attention decode kernel: one query token per sequence attends over its cached K/V blocks.

One program per (sequence, kv head, context split) computes all H/G query heads of that group with an online
softmax over `BLOCK_N` keys at a time, reading K/V straight from the paged cache through the block table (no
gather copy, static shapes, so it can live inside a CUDA graph). Few rows (small B) split the context so every
SM has work; a second kernel merges the splits' (max, sum, acc). With `FreshKV` (an experiment for few rows) the
kernel also applies the q/k norm and RoPE to the new token and writes its k, v into the cache. Tested on CPU with
TRITON_INTERPRET=1.
Shapes: B sequences, H query heads, G kv heads, Dk/Dv head dims, N max blocks per sequence.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from moeloop.model import kernel_switch
from moeloop.model.kernel_switch import pdl_args, triton, triton_interpreting  # noqa: F401 (re-exported)

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait


def triton_available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _attend_block(q, m_i, l_i, acc, start, ctx_len, b, g, k_ptr, v_ptr, tables_ptr, scale,
                      s_ks, s_kg, s_vs, s_vg, s_tb, DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr,
                      DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      V_EARLY: tl.constexpr, k_new, v_new, FOLD: tl.constexpr):
        """One online-softmax step over positions [start, start + BLOCK_N) (masked past ctx_len). V_EARLY: V is
        read with K, both in flight at once (a split's one block: latency), not after the scores (registers).
        FOLD: position ctx_len - 1 takes k_new / v_new ([1, D]: the new token's, computed by this program) instead
        of the cache row, which this kernel itself writes."""
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < ctx_len
        blk = tl.load(tables_ptr + b * s_tb + pos // BLOCK_SIZE, mask=p_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(k_ptr + slot[:, None] * s_ks + g * s_kg + dk[None, :],
                    mask=p_ok[:, None] & (dk[None, :] < DK), other=0.0)
        if FOLD:
            k = tl.where((pos == ctx_len - 1)[:, None], k_new.to(k.dtype), k)
        v_rows = v_ptr + slot[:, None] * s_vs + g * s_vg + dv[None, :]
        v_ok = p_ok[:, None] & (dv[None, :] < DV)
        if V_EARLY:
            v = tl.load(v_rows, mask=v_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block before any real one
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if not V_EARLY:
            v = tl.load(v_rows, mask=v_ok, other=0.0)
        if FOLD:
            v = tl.where((pos == ctx_len - 1)[:, None], v_new.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def normed_rotated(x1, x2, rs, w1, w2, c1, c2, s1, s2, QK_NORM: tl.constexpr, dt: tl.constexpr):
        """Elementwise, any broadcastable shapes: the halves x1, x2 (fp32) of heads, with QK_NORM scaled by rs
        (their reciprocal RMS) and times the norm weight halves w1, w2, then half-split RoPE, x * cos + cat(-x2, x1)
        * sin (c1, c2, s1, s2: cos / sin halves); each product and sum rounded to dt as the module path rounds
        them. The two halves in dt. The callers reduce rs themselves (their layouts differ)."""
        if QK_NORM:
            x1 = (w1 * (x1 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _norm_rope_rows(x_ptr, w_ptr, c1, c2, s1, s2, eps, ok, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                        dt: tl.constexpr):
        """Rows [R, 2 * HALF] at x_ptr ([R, 1] row pointers, rows not ok read as 0): `normed_rotated` (c1, c2, s1,
        s2: [HALF] cos / sin halves) -> the two halves [R, HALF] in dt."""
        i = tl.arange(0, HALF)[None, :]
        x1 = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
        rs, w1, w2 = x1, x1, x1  # (used with QK_NORM only)
        if QK_NORM:
            rs = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
            w1, w2 = tl.load(w_ptr + i).to(tl.float32), tl.load(w_ptr + HALF + i).to(tl.float32)
        return normed_rotated(x1, x2, rs, w1, w2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], QK_NORM, dt)

    @triton.jit
    def _halves_joined(o1, o2, R: tl.constexpr, D: tl.constexpr):
        """[R, D] from the halves [R, D // 2] each: [o1 | o2] per row."""
        return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (R, D))

    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, tables_ptr, lens_ptr, scale,
                      s_qb, s_qh, s_ks, s_kg, s_vs, s_vg, s_ob, s_oh, s_tb,
                      kr_ptr, vr_ptr, s_kr, s_vr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, eps,
                      QH: tl.constexpr, QH_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                      DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                      DYNAMIC_LOOP: tl.constexpr, V_EARLY: tl.constexpr, FOLD: tl.constexpr, QK_NORM: tl.constexpr,
                      EARLY: tl.constexpr, PDL: tl.constexpr):
        """FOLD (`FreshKV`): q_ptr holds the raw q projection rows (stride s_qb, heads s_qh = DK apart), and the new
        token's raw k, v rows are at kr_ptr / vr_ptr: each program applies the q/k norm and RoPE itself (q of its
        QH heads, k of its kv head), uses the new k, v for position ctx_len - 1, and the program whose positions
        hold ctx_len - 1 writes them into the cache slot slots[b] (no separate q/k norm + RoPE + store kernel)."""
        pdl_launch_next(PDL, EARLY)
        b = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        ctx_len = tl.load(lens_ptr + b)  # (lengths and block tables: written before the step's first kernel)
        if FOLD:  # (the RoPE tables and the new slot: also written before the step's first kernel)
            half = tl.arange(0, DK // 2)
            c1 = tl.load(cos_ptr + b * DK + half).to(tl.float32)
            c2 = tl.load(cos_ptr + b * DK + DK // 2 + half).to(tl.float32)
            s1 = tl.load(sin_ptr + b * DK + half).to(tl.float32)
            s2 = tl.load(sin_ptr + b * DK + DK // 2 + half).to(tl.float32)
            slot_new = tl.load(slots_ptr + b).to(tl.int64)
        pdl_wait(PDL, EARLY)
        h = tl.arange(0, QH_PAD)
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        h_ok = h < QH
        if FOLD:  # (DK = DK_PAD = DV = DV_PAD: a power-of-two head dim, `fused_supported`)
            dt = q_ptr.dtype.element_ty
            q1, q2 = _norm_rope_rows(q_ptr + b * s_qb + (g * QH + h)[:, None] * s_qh, qw_ptr, c1, c2, s1, s2, eps,
                                     h_ok[:, None], DK // 2, QK_NORM, dt)
            q = _halves_joined(q1, q2, QH_PAD, DK)
            k1, k2 = _norm_rope_rows(kr_ptr + b * s_kr + g * DK + tl.zeros([1, 1], tl.int32), kw_ptr, c1, c2, s1, s2,
                                     eps, tl.zeros([1, 1], tl.int32) == 0, DK // 2, QK_NORM, dt)
            k_new = _halves_joined(k1, k2, 1, DK).to(k_ptr.dtype.element_ty)
            v_new = tl.load(vr_ptr + b * s_vr + g * DV + dv[None, :]).to(v_ptr.dtype.element_ty)
            # one program of this (row, kv head) holds position ctx_len - 1: it writes the new row (the test as a
            # vector: triton 3.9's interpreter rejects a scalar mixed into a mask)
            last = ctx_len - 1 + 0 * dk[None, :]
            mine = (last >= sp * CHUNK) & (last < sp * CHUNK + CHUNK)
            tl.store(k_ptr + slot_new * s_ks + g * s_kg + dk[None, :], k_new, mask=mine & (dk[None, :] < DK))
            tl.store(v_ptr + slot_new * s_vs + g * s_vg + dv[None, :], v_new, mask=mine & (dv[None, :] < DV))
        else:
            q = tl.load(q_ptr + b * s_qb + (g * QH + h)[:, None] * s_qh + dk[None, :],
                        mask=h_ok[:, None] & (dk[None, :] < DK), other=0.0)
            k_new, v_new = q, q  # (unused)
        m_i = tl.full([QH_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([QH_PAD], tl.float32)
        acc = tl.zeros([QH_PAD, DV_PAD], tl.float32)
        if DYNAMIC_LOOP:  # one split: loop to this row's length (compiled only; see paged_decode_attention)
            for start in range(0, ctx_len, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, ctx_len, b, g, k_ptr, v_ptr, tables_ptr, scale,
                                              s_ks, s_kg, s_vs, s_vg, s_tb, DK, DK_PAD, DV, DV_PAD,
                                              BLOCK_SIZE, BLOCK_N, PRECISION, V_EARLY, k_new, v_new, FOLD)
        else:  # static trip count: the interpreter cannot loop from a program-id-derived start
            for i in range(0, CHUNK, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, sp * CHUNK + i, ctx_len, b, g, k_ptr, v_ptr,
                                              tables_ptr, scale, s_ks, s_kg, s_vs, s_vg, s_tb, DK, DK_PAD, DV,
                                              DV_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, V_EARLY, k_new, v_new, FOLD)
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + b * s_ob + (g * QH + h)[:, None] * s_oh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & (dv[None, :] < DV))
        else:  # partials [B, S, H, (Dv)] in fp32, unnormalised; an empty split leaves (-inf, 0, 0)
            row = (b * NUM_SPLITS + sp) * (QH * tl.num_programs(1)) + g * QH + h
            tl.store(m_ptr + row, m_i, mask=h_ok)
            tl.store(l_ptr + row, l_i, mask=h_ok)
            tl.store(o_ptr + row[:, None] * DV + dv[None, :], acc, mask=h_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _merge_splits(part_ptr, m_ptr, l_ptr, o_ptr, s_ob, s_oh, H: tl.constexpr, DV: tl.constexpr,
                      DV_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, EARLY: tl.constexpr,
                      PDL: tl.constexpr):
        pdl_launch_next(PDL, EARLY)
        pdl_wait(PDL, EARLY)
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        dv = tl.arange(0, DV_PAD)
        sp_ok = sp < NUM_SPLITS
        row = (b * NUM_SPLITS + sp) * H + h
        m = tl.load(m_ptr + row, mask=sp_ok, other=float("-inf"))
        l = tl.load(l_ptr + row, mask=sp_ok, other=0.0)
        w = tl.where(l > 0, tl.exp(m - tl.max(m, 0)), 0.0)  # split 0 always holds position 0, so max(m) is finite
        acc = tl.load(part_ptr + row[:, None] * DV + dv[None, :], mask=sp_ok[:, None] & (dv[None, :] < DV), other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + b * s_ob + h * s_oh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


# split programs (few rows) read V together with K (`_attend_block`); MOELOOP_V_EARLY=off reads it after the scores
V_EARLY = os.environ.get("MOELOOP_V_EARLY", "on").lower() != "off"
_NUM_SMS: dict[torch.device, int] = {}


def num_splits(device: torch.device, num_programs: int, max_len: int, block_n: int) -> int:
    """Context splits so that about two programs run per SM (1 when the rows alone fill the device)."""
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = -(-2 * _NUM_SMS[device] // num_programs)
    return max(1, min(wanted, -(-max_len // block_n), 16))


class FreshKV(NamedTuple):
    """A decode batch's new token before the q/k norm and RoPE, for `paged_decode_attention` to finish in the
    attention kernel: raw projections q [B, H * D], k [B, G * D], v [B, G * Dv] (rows may be strided column slices
    of one q|k|v output), the norms' weights (None: no q/k norm) and eps, the RoPE tables [B, D] at the new
    positions, and the cache slots [B] the new k, v go to."""
    q_BX: torch.Tensor
    k_BX: torch.Tensor
    v_BX: torch.Tensor
    q_norm_w: torch.Tensor | None
    k_norm_w: torch.Tensor | None
    eps: float
    cos_BD: torch.Tensor
    sin_BD: torch.Tensor
    slots_B: torch.Tensor


def paged_decode_attention(q_BHD: torch.Tensor | None, k_cache_SGD: torch.Tensor, v_cache_SGDv: torch.Tensor,
                           block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor, block_size: int,
                           scale: float, block_n: int = 64, split: bool = True,
                           fresh: FreshKV | None = None) -> torch.Tensor:
    """Attention of each row's single query over its first context_lens_B[b] cached positions -> [B, H, Dv].
    With `fresh` (q_BHD None): the query and the newest position's k, v are computed in the kernel from the raw
    projections, and written into the cache there (the fold of `fused_decode.qk_norm_rope_store`)."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    G, Dk, Dv = k_cache_SGD.shape[1], k_cache_SGD.shape[2], v_cache_SGDv.shape[2]
    if fresh is not None:
        q_ref = fresh.q_BX
        B, H = q_ref.shape[0], q_ref.shape[1] // Dk
        if q_ref.stride(1) != 1 or fresh.k_BX.stride(1) != 1 or fresh.v_BX.stride(1) != 1 or Dk != Dv \
                or Dk & (Dk - 1) or Dk < 16:
            raise ValueError("paged_decode_attention(fresh=...) takes rows of unit column stride and one "
                             f"power-of-two head dim of at least 16 (k {Dk}, v {Dv})")
        q_args = (q_ref, q_ref.stride(0), Dk)
        qk_norm = fresh.q_norm_w is not None
        fold_args = (fresh.k_BX, fresh.v_BX, fresh.k_BX.stride(0), fresh.v_BX.stride(0),
                     fresh.q_norm_w if qk_norm else q_ref, fresh.k_norm_w if qk_norm else q_ref,
                     fresh.cos_BD.contiguous(), fresh.sin_BD.contiguous(), fresh.slots_B, fresh.eps)
    else:
        q_ref = q_BHD
        B, H, _ = q_BHD.shape
        q_args = (q_BHD, q_BHD.stride(0), q_BHD.stride(1))
        qk_norm = False
        fold_args = (q_BHD, q_BHD, 0, 0, q_BHD, q_BHD, q_BHD, q_BHD, context_lens_B, 0.0)
    out = q_ref.new_empty(B, H, Dv)
    qh = H // G
    block_n = max(16, min(block_n, triton.next_power_of_2(block_size) * 8))
    precision = "ieee" if q_ref.dtype == torch.float32 else "tf32"
    max_len = block_tables_BN.shape[1] * block_size  # static: the grid must not depend on the lengths (graphs)
    splits = num_splits(q_ref.device, B * G, max_len, block_n) if split else 1
    chunk = -(-max_len // splits // block_n) * block_n
    splits = -(-max_len // chunk)
    dv_pad = max(16, triton.next_power_of_2(Dv))
    dest, m, l = out, out, out
    pdl = pdl_args(q_ref, B)
    if splits > 1:
        dest = torch.empty(B, splits, H, Dv, dtype=torch.float32, device=q_ref.device)
        m = torch.empty(B, splits, H, dtype=torch.float32, device=q_ref.device)
        l = torch.empty_like(m)
    q_ptr, s_qb, s_qh = q_args
    _paged_decode[(B, G, splits)](
        q_ptr, k_cache_SGD, v_cache_SGDv, dest, m, l, block_tables_BN, context_lens_B, scale,
        s_qb, s_qh, k_cache_SGD.stride(0), k_cache_SGD.stride(1),
        v_cache_SGDv.stride(0), v_cache_SGDv.stride(1), out.stride(0), out.stride(1), block_tables_BN.stride(0),
        *fold_args,
        QH=qh, QH_PAD=max(16, triton.next_power_of_2(qh)), DK=Dk, DK_PAD=max(16, triton.next_power_of_2(Dk)),
        DV=Dv, DV_PAD=dv_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION=precision, NUM_SPLITS=splits, CHUNK=chunk, V_EARLY=V_EARLY and splits > 1,
        FOLD=fresh is not None, QK_NORM=qk_norm, EARLY=kernel_switch.PDL_EARLY, num_warps=4, **pdl,
        DYNAMIC_LOOP=splits == 1 and not triton_interpreting(),  # the interpreter: static trip counts only
        # (the fold's RoPE products are rounded one by one, as the module path rounds them: no FMA)
        **({"enable_fp_fusion": False} if fresh is not None else {}))
    if splits > 1:
        _merge_splits[(B, H)](dest, m, l, out, out.stride(0), out.stride(1), H=H, DV=Dv, DV_PAD=dv_pad,
                              NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                              EARLY=kernel_switch.PDL_EARLY, num_warps=4, **pdl)
    return out
