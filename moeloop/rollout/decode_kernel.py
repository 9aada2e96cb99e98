"""Triton paged-attention decode kernel: one query token per sequence attends over its cached K/V blocks.

One program per (sequence, kv head, context split) computes all H/G query heads of that group with an online
softmax over `BLOCK_N` keys at a time, reading K/V straight from the paged cache through the block table (no
gather copy, static shapes, so it can live inside a CUDA graph). Few rows (small B) split the context so every
SM has work; a second kernel merges the splits' (max, sum, acc). Tested on CPU with TRITON_INTERPRET=1.
Shapes: B sequences, H query heads, G kv heads, Dk/Dv head dims, N max blocks per sequence.
"""
from __future__ import annotations

import os

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
                      V_EARLY: tl.constexpr):
        """One online-softmax step over positions [start, start + BLOCK_N) (masked past ctx_len). V_EARLY: V is
        read with K, both in flight at once (a split's one block: latency), not after the scores (registers)."""
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < ctx_len
        blk = tl.load(tables_ptr + b * s_tb + pos // BLOCK_SIZE, mask=p_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(k_ptr + slot[:, None] * s_ks + g * s_kg + dk[None, :],
                    mask=p_ok[:, None] & (dk[None, :] < DK), other=0.0)
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
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, tables_ptr, lens_ptr, scale,
                      s_qb, s_qh, s_ks, s_kg, s_vs, s_vg, s_ob, s_oh, s_tb,
                      QH: tl.constexpr, QH_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                      DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                      DYNAMIC_LOOP: tl.constexpr, V_EARLY: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        pdl_launch_next(PDL, EARLY)
        b = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        ctx_len = tl.load(lens_ptr + b)  # (lengths and block tables: written before the step's first kernel)
        pdl_wait(PDL, EARLY)
        h = tl.arange(0, QH_PAD)
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        h_ok = h < QH
        q = tl.load(q_ptr + b * s_qb + (g * QH + h)[:, None] * s_qh + dk[None, :],
                    mask=h_ok[:, None] & (dk[None, :] < DK), other=0.0)
        m_i = tl.full([QH_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([QH_PAD], tl.float32)
        acc = tl.zeros([QH_PAD, DV_PAD], tl.float32)
        if DYNAMIC_LOOP:  # one split: loop to this row's length (compiled only; see paged_decode_attention)
            for start in range(0, ctx_len, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, ctx_len, b, g, k_ptr, v_ptr, tables_ptr, scale,
                                              s_ks, s_kg, s_vs, s_vg, s_tb, DK, DK_PAD, DV, DV_PAD,
                                              BLOCK_SIZE, BLOCK_N, PRECISION, V_EARLY)
        else:  # static trip count: the interpreter cannot loop from a program-id-derived start
            for i in range(0, CHUNK, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, sp * CHUNK + i, ctx_len, b, g, k_ptr, v_ptr,
                                              tables_ptr, scale, s_ks, s_kg, s_vs, s_vg, s_tb, DK, DK_PAD, DV,
                                              DV_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, V_EARLY)
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


# context splits per (row, kv head) at most (`benchmarks/b1_tiles.py` sweeps it at B=1)
MAX_SPLITS = kernel_switch.env_tile("MOELOOP_MAX_SPLITS", (16,), powers_of_two=False)[0]


def num_splits(device: torch.device, num_programs: int, max_len: int, block_n: int) -> int:
    """Context splits so that about two programs run per SM (1 when the rows alone fill the device), at most
    MAX_SPLITS."""
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = -(-2 * _NUM_SMS[device] // num_programs)
    return max(1, min(wanted, -(-max_len // block_n), MAX_SPLITS))


# cached positions per loop step, and the split programs' chunk unit (`benchmarks/b1_tiles.py`)
PAGED_BLOCK_N = kernel_switch.env_tile("MOELOOP_PAGED_BLOCK_N", (64,))[0]
# the paged decode's warps and software-pipeline stages (how many loop steps' K/V loads a one-split program keeps in
# flight; a split program runs one step): triton's default 3 stages. At B=1 one pipelined program per kv head (no
# merge launch) measured 43-54 us per forward slower than the splits at 3-6 stages and 4-8 warps, two splits 24 us
# (H200, BENCHMARKS.md, session 15): four SMs cannot stream the context as fast as 24 programs
PAGED_WARPS = 4
PAGED_STAGES = kernel_switch.env_tile("MOELOOP_PAGED_STAGES", (3,), powers_of_two=False)[0]
# one row (B=1): 8 warps a program. H200, session 24: `b1_tiles.py` "defaults 0.3480 ms, paged_warps=8 0.3443 ms,
# +3.7 us per forward"; rollout.py B=1 engine.step 2.877/2.877 against 2.896/2.899 ms per 8 steps (alternating).
# B=32 and 256 with 8 warps read 60.2% / 61.8% of the roofline in that call (63.4% / 63.7% at 4 in session 23), so
# more rows keep PAGED_WARPS
PAGED_WARPS_ONE_ROW = kernel_switch.env_tile("MOELOOP_PAGED_WARPS_ONE_ROW", (8,))[0]
# the split merge's warps a program: 1 (12 programs at B=1 for the reference model; its reductions over the splits
# take 5 barriers at 4 warps, none at 1: sm_90 PTX). H200, session 25: `b1_tiles.py` "defaults 0.3457 ms,
# merge_warps=1 0.3417 ms, +4.0 us per forward"; rollout.py engine.step in alternation, B=1 2.881/2.879/2.874 against
# 2.890/2.884/2.879 ms per 8 steps, B=32 14.610/14.638 against 14.724/14.775 (B=256 runs one split, no merge)
MERGE_WARPS = kernel_switch.env_tile("MOELOOP_MERGE_WARPS", (1,))[0]


def paged_decode_attention(q_BHD: torch.Tensor, k_cache_SGD: torch.Tensor, v_cache_SGDv: torch.Tensor,
                           block_tables_BN: torch.Tensor, context_lens_B: torch.Tensor, block_size: int,
                           scale: float, block_n: int | None = None, split: bool = True) -> torch.Tensor:
    """Attention of each row's single query over its first context_lens_B[b] cached positions -> [B, H, Dv]
    (`block_n`: default PAGED_BLOCK_N). Split programs per kv group (`_paged_decode`), then the merge."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    B, H, Dk = q_BHD.shape
    G, Dv = k_cache_SGD.shape[1], v_cache_SGDv.shape[2]
    out = q_BHD.new_empty(B, H, Dv)
    qh = H // G
    block_n = max(16, min(PAGED_BLOCK_N if block_n is None else block_n, triton.next_power_of_2(block_size) * 8))
    precision = "ieee" if q_BHD.dtype == torch.float32 else "tf32"
    max_len = block_tables_BN.shape[1] * block_size  # static: the grid must not depend on the lengths (graphs)
    splits = num_splits(q_BHD.device, B * G, max_len, block_n) if split else 1
    chunk = -(-max_len // splits // block_n) * block_n
    splits = -(-max_len // chunk)
    dv_pad = max(16, triton.next_power_of_2(Dv))
    dest, m, l = out, out, out
    pdl = pdl_args(q_BHD, B)
    if splits > 1:
        dest = torch.empty(B, splits, H, Dv, dtype=torch.float32, device=q_BHD.device)
        m = torch.empty(B, splits, H, dtype=torch.float32, device=q_BHD.device)
        l = torch.empty_like(m)
    _paged_decode[(B, G, splits)](
        q_BHD, k_cache_SGD, v_cache_SGDv, dest, m, l, block_tables_BN, context_lens_B, scale,
        q_BHD.stride(0), q_BHD.stride(1), k_cache_SGD.stride(0), k_cache_SGD.stride(1),
        v_cache_SGDv.stride(0), v_cache_SGDv.stride(1), out.stride(0), out.stride(1), block_tables_BN.stride(0),
        QH=qh, QH_PAD=max(16, triton.next_power_of_2(qh)), DK=Dk, DK_PAD=max(16, triton.next_power_of_2(Dk)),
        DV=Dv, DV_PAD=dv_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION=precision, NUM_SPLITS=splits, CHUNK=chunk, V_EARLY=V_EARLY and splits > 1,
        EARLY=kernel_switch.PDL_EARLY, num_warps=PAGED_WARPS_ONE_ROW if B == 1 else PAGED_WARPS,
        num_stages=PAGED_STAGES, **pdl,
        DYNAMIC_LOOP=splits == 1 and not triton_interpreting())  # the interpreter: static trip counts only
    if splits > 1:
        _merge_splits[(B, H)](dest, m, l, out, out.stride(0), out.stride(1), H=H, DV=Dv, DV_PAD=dv_pad,
                              NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                              EARLY=kernel_switch.PDL_EARLY, num_warps=MERGE_WARPS, **pdl)
    return out
