"""One token's q|k|v launch with the RoPE and the q/k head norm's sums in it (`ROPE_QKV`): no q/k norm launch.

The module path rotates w * raw / rms(raw) for each q and k head (raw: the head's projection, w: the head norm's
weight). rms is one positive scalar per head, and RoPE is linear, so that equals RoPE(w * raw) / rms(raw). A
program of the q|k|v launch holds BLOCK_N // 2 RoPE pairs (dims i and i + Dh / 2 of one head), so it can rotate
them itself; it stores u = RoPE(w * raw) in fp32 and its rows' sum of squares of raw. The paged decode
(`decode_kernel._paged_decode` with FRESH) adds a head's partial sums, scales q by 1 / rms, does the same for the
new token's k, and writes that k into the cache (the one program whose split holds the new position; no other
program reads it). The v rows go straight to the cache. Rounding: raw is rounded to the model dtype as the module
path's projection is; the norm and RoPE products are fp32 and rounded once, where the module path rounds after
the norm, the weight and each RoPE product (fp32 models: the same values up to fp32 rounding).
Shapes: D model dim, H/G query/kv heads, Dh head dim, P RoPE pairs per program, NP = Dh / 2 / P programs per head.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from moeloop.model import kernel_switch
from moeloop.model.kernel_switch import pdl_args
from moeloop.model.norm import RMSNorm
from moeloop.model.rope import RopeTables
from moeloop.rollout.decode_kernel import FreshQK, triton
from moeloop.rollout.decode_packs import ROW_MAX_D

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait
    from moeloop.rollout.moe_kernel import _rmsnorm_row

    @triton.jit
    def _normed_row(x_ptr, res_ptr, nw, y_ptr, res_out_ptr, eps, pid, d, ok, D: tl.constexpr, HAS_RES: tl.constexpr,
                    WRITE_Y: tl.constexpr, EMBED: tl.constexpr):
        """y = RMSNorm(res + x) (no res: RMSNorm(x)) of one token's row for a projection program, after its wait,
        with `_add_rmsnorm`'s rounding points (norm weight nw, fp32); program 0 also stores res + x (and y, WRITE_Y).
        EMBED (no res): x is row res_ptr[0] (the token id) of the embedding table at x_ptr, stored into res_out by
        program 0."""
        dt = x_ptr.dtype.element_ty
        if EMBED:
            x = tl.load(x_ptr + tl.load(res_ptr).to(tl.int64) * D + d, mask=ok, other=0.0)
            if pid == 0:
                tl.store(res_out_ptr + d, x, mask=ok)
        else:
            x = tl.load(x_ptr + d, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + d, mask=ok, other=0.0).to(tl.float32)).to(dt)
            if pid == 0:
                tl.store(res_out_ptr + d, x, mask=ok)
        y = _rmsnorm_row(x, nw, eps, D, dt)
        if WRITE_Y:
            if pid == 0:
                tl.store(y_ptr + d, y, mask=ok)
        return y

    @triton.jit
    def _norm_qkv_rope(x_ptr, res_ptr, nw_ptr, res_out_ptr, wq_ptr, wk_ptr, wv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                       pos_ptr, slots_ptr, u_ptr, ssq_ptr, vc_ptr, s_vc, s_vg, eps, H: tl.constexpr,
                       G: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, QK_NORM: tl.constexpr, EMBED: tl.constexpr,
                       EARLY: tl.constexpr, PDL: tl.constexpr):
        """One token: y = RMSNorm(res + x) (`_normed_row`), then its q, k, v rows. Programs below (H + G) * NP:
        head hd = pid // NP (q heads, then k heads), pairs j * P .. j * P + P - 1 (j = pid % NP) and their partners
        HALF on, held interleaved (lo, hi, lo, hi, ...): u[hd] at those dims = RoPE(w * raw) in fp32 (w: the q or k
        head norm's weight, QK_NORM), and ssq[hd, j] = the sum of raw^2 over the program's rows. The rest: BLOCK_N v
        rows each, rounded and stored into the v cache at the token's slot. Weights (and norm weights) are read
        before the PDL wait; the position and the slot after it (the sampler that writes them may still run)."""
        pdl_launch_next(PDL, EARLY)
        pid = tl.program_id(0)
        P: tl.constexpr = BLOCK_N // 2
        NP: tl.constexpr = HALF // P
        DH: tl.constexpr = 2 * HALF
        r = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        hd = pid // NP
        row = (pid % NP) * P + r // 2 + (r % 2) * HALF  # dims of head hd, pairs interleaved
        rotates = pid < (H + G) * NP
        v_row = (pid - (H + G) * NP) * BLOCK_N + r
        if rotates:
            if hd < H:
                w_rows = wq_ptr + (hd * DH + row).to(tl.int64)[:, None] * D
            else:
                w_rows = wk_ptr + ((hd - H) * DH + row).to(tl.int64)[:, None] * D
        else:
            w_rows = wv_ptr + v_row.to(tl.int64)[:, None] * D
        w = tl.load(w_rows + d[None, :], mask=ok[None, :], other=0.0)
        nw = tl.load(nw_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if QK_NORM:  # (row < DH for every program: a v program's load is in bounds and unused)
            hw = tl.where(hd < H, tl.load(qw_ptr + row), tl.load(kw_ptr + row)).to(tl.float32)
        pdl_wait(PDL, EARLY)
        y = _normed_row(x_ptr, res_ptr, nw, res_out_ptr, res_out_ptr, eps, pid, d, ok, D, HAS_RES, False, EMBED)
        dt = x_ptr.dtype.element_ty
        raw = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], 1).to(dt).to(tl.float32)
        if rotates:
            p = tl.load(pos_ptr).to(tl.int64)
            tl.store(ssq_ptr + pid, tl.sum(raw * raw, 0))
            x = raw * hw if QK_NORM else raw
            lo, hi = tl.split(tl.reshape(x, (P, 2)))
            c_lo, c_hi = tl.split(tl.reshape(tl.load(cos_ptr + p * DH + row).to(tl.float32), (P, 2)))
            s_lo, s_hi = tl.split(tl.reshape(tl.load(sin_ptr + p * DH + row).to(tl.float32), (P, 2)))
            # x * cos + cat(-x2, x1) * sin, as the module path's half-split RoPE
            u = tl.reshape(tl.join(lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi), (BLOCK_N,))
            tl.store(u_ptr + hd * DH + row, u)
        else:
            slot = tl.load(slots_ptr).to(tl.int64)
            tl.store(vc_ptr + slot * s_vc + (v_row // DH) * s_vg + v_row % DH, raw.to(vc_ptr.dtype.element_ty))


# B=1: the q/k head norm and RoPE in the q|k|v launch and the paged decode (module docstring), the q/k norm launch
# gone; MOELOOP_ROPE_QKV=on turns it on (off until measured on the H200)
ROPE_QKV = os.environ.get("MOELOOP_ROPE_QKV", "off").lower() == "on"
ROPE_QKV_TILE = (4, 4)  # (rows per program: RoPE pairs times 2, warps), as `fused_decode.ROW_LINEAR_TILE`


def rope_qkv_applies(x_TD: torch.Tensor, attn: nn.Module, rope: RopeTables, v_cache: torch.Tensor,
                     kernel_attention: bool) -> bool:
    """`normed_qkv_rope` takes this token: `ROPE_QKV` on, one token of a half-split RoPE model through the paged
    decode kernel (`kernel_attention`), bias-free contiguous q/k/v weights of x's dtype and width (up to a row a
    program holds whole), the v cache of that dtype, head dims of whole pairs per program."""
    block_n = ROPE_QKV_TILE[0]
    half = attn.head_dim // 2
    ws = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    return (ROPE_QKV and triton is not None and kernel_attention and x_TD.shape[0] == 1 and not rope.interleaved
            and x_TD.is_contiguous() and triton.next_power_of_2(x_TD.shape[1]) <= ROW_MAX_D
            and half % (block_n // 2) == 0 and v_cache.dtype == x_TD.dtype and v_cache.shape[2] == attn.head_dim
            and v_cache.stride(2) == 1
            and all(getattr(m, "bias", None) is None for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            and all(w.dtype == x_TD.dtype and w.shape[1] == x_TD.shape[1] and w.is_contiguous() for w in ws)
            and ws[2].shape[0] % block_n == 0)


def normed_qkv_rope(x_TD: torch.Tensor, res_TD: torch.Tensor | None, norm: RMSNorm, attn: nn.Module,
                    rope: RopeTables, pos_T: torch.Tensor, v_cache: torch.Tensor, slots_T: torch.Tensor,
                    ids_T: torch.Tensor | None = None, lens_late: bool = False) -> tuple[torch.Tensor, FreshQK]:
    """(res + x [1, D], the new token's `FreshQK` for the paged decode) of y = RMSNorm(res + x) in one launch
    (`_norm_qkv_rope`); v goes into v_cache at slots_T[0]. With `ids_T` (no res), x_TD is the embedding table and x
    its row ids_T[0]. `lens_late`: the paged decode reads the lengths after its wait (no kernel between the sampler
    that writes them and it triggers late: the first layer)."""
    block_n, warps = ROPE_QKV_TILE
    D = x_TD.shape[1]
    H, G, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    n_pairs = Dh // 2 // (block_n // 2)  # programs per rotated head
    u = torch.empty(1, H + G, Dh, dtype=torch.float32, device=x_TD.device)
    ssq = torch.empty(1, H + G, n_pairs, dtype=torch.float32, device=x_TD.device)
    if ids_T is not None:
        res_out, res_in = x_TD.new_empty(1, D), ids_T
    else:
        res_out = x_TD if res_TD is None else torch.empty_like(x_TD)
        res_in = x_TD if res_TD is None else res_TD
    qk_norm = hasattr(attn, "q_norm")
    qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if qk_norm else (u, u)
    grid = (H + G) * n_pairs + attn.v_proj.weight.shape[0] // block_n
    _norm_qkv_rope[(grid,)](x_TD, res_in, norm.weight, res_out, attn.q_proj.weight, attn.k_proj.weight,
                            attn.v_proj.weight, qw, kw, rope.cos_TR, rope.sin_TR, pos_T, slots_T, u, ssq, v_cache,
                            v_cache.stride(0), v_cache.stride(1), norm.eps, H=H, G=G, HALF=Dh // 2, D=D,
                            BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D), HAS_RES=res_TD is not None,
                            QK_NORM=qk_norm, EMBED=ids_T is not None, EARLY=kernel_switch.PDL_EARLY,
                            num_warps=warps, **pdl_args(x_TD, 1))
    eps = attn.q_norm.eps if qk_norm else 0.0
    return res_out, FreshQK(u, ssq if qk_norm else None, slots_T, eps, x_TD.dtype, H, lens_late)
