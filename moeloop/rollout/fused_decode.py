"""Fused decode forward for the rollout engine's CUDA path: the same weights and rounding points as
`MoEForCausalLM.forward`, in about 13 kernels per layer instead of about 60.

Per layer: residual add + RMSNorm (one kernel), the q/k/v projections (one `_row_linear` launch for a single
token, else one cuBLAS GEMM on the packed q|k|v copy), q/k head RMSNorm + RoPE + the K/V cache write (one
kernel), paged attention, o_proj, add + RMSNorm, the router projection, softmax + top-k + renormalisation (one
kernel with the projection inside from 16 tokens on, its hidden dim split over six programs per 16 tokens), and
the experts (`moe_kernel`: two kernels for a few tokens; for more, a sort and two grouped GEMMs whose rows'
weighted sum is fused into the next add + RMSNorm).
Every bf16 rounding of the module path is kept (norm output, weight product, each RoPE product and sum, residual
sums), so outputs match it up to fp32 summation order inside a norm. On Hopper the kernels are launched with
programmatic dependent launch (`kernel_switch.pdl_args`): the one-token projections and expert kernels read
their weight tiles while the kernel before them is still running. Used for decode-only batches of GQA models with
half-split RoPE over the whole head and a softmax router (Qwen3-MoE, Qwen3, Llama, Mixtral); `fused_supported` says when.
For one token, `NORM_FOLD` (on; MOELOOP_NORM_FOLD=off turns it off) runs the add + RMSNorm before the q|k|v and
router projections inside them (`_norm_row_linear`), two launches fewer per layer (H200, B=1: forward graph
0.477 -> 0.451 ms). Two more folds for one token: the expert kernels rank the router logits themselves
(`moe_kernel.ROUTE_FOLD`, no top-k launch: 0.417 -> 0.401 ms) and layer 0's q|k|v launch reads the embedding row
(`EMBED_FOLD`, no lookup launch: 0.404 -> 0.401 ms), which leaves eight kernels per layer. The router is then
composed into the o_proj launch (`ROUTER_COMPOSE`, `ComposedRouter`: its logits come from [attention output |
residual] through a precomputed product, the expert kernels apply the norm), which leaves seven.
Shapes: T tokens, D model dim, H/G query/kv heads, Dh head dim, E experts, K experts per token.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from moeloop.model import kernel_switch
from moeloop.model.kernel_switch import kernels_apply, pdl_args
from moeloop.model.moe import MoE
from moeloop.model.norm import RMSNorm
from moeloop.model.rope import RopeTables
from moeloop.rollout import decode_packs
from moeloop.rollout.decode_kernel import triton
from moeloop.rollout.decode_packs import ROW_MAX_D, ComposedRouter
from moeloop.rollout.gumbel_kernel import row_counters
from moeloop.rollout.moe_kernel import (composed_applies, fused_experts, grouped_expert_rows, routed_experts,
                                        routed_experts_apply, uses_grouped_rows)
from moeloop.rollout.paged_attention import PagedAttention

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait
    from moeloop.rollout.gumbel_kernel import last_arrival
    from moeloop.rollout.moe_kernel import _rmsnorm_row

    @triton.jit
    def _add_rmsnorm(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, dest_ptr, wts_ptr, eps, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, COMBINE_K: tl.constexpr, PDL: tl.constexpr):
        """COMBINE_K > 0: x is first the weighted sum of COMBINE_K expert rows x[dest[row, k]] (fp32, rounded)."""
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        dt = y_ptr.dtype.element_ty
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        if COMBINE_K > 0:
            acc = tl.zeros([BLOCK_D], tl.float32)
            for k in tl.static_range(COMBINE_K):
                src = tl.load(dest_ptr + row * COMBINE_K + k)
                acc += tl.load(x_ptr + src * D + d, mask=ok, other=0.0).to(tl.float32) * tl.load(wts_ptr + row * COMBINE_K + k)
            x = acc.to(dt)
        else:
            x = tl.load(x_ptr + row * D + d, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)).to(dt)
            tl.store(res_out_ptr + row * D + d, x, mask=ok)
        tl.store(y_ptr + row * D + d, _rmsnorm_row(x, w, eps, D, dt), mask=ok)

    @triton.jit
    def _token_rope(pos_ptr, slots_ptr, cos_ptr, sin_ptr, t, HALF: tl.constexpr):
        """Token t's cache slot and the row of the cos/sin tables at its position, as halves (slot, c1, c2, s1, s2;
        fp32)."""
        slot = tl.load(slots_ptr + t)
        t = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + t * 2 * HALF + i).to(tl.float32)
        c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + t * 2 * HALF + i).to(tl.float32)
        s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + i).to(tl.float32)
        return slot, c1, c2, s1, s2

    @triton.jit
    def _norm_rope_half(x_ptr, w1, w2, c1, c2, s1, s2, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                        dt: tl.constexpr):
        """One head [2 * HALF] at x_ptr: optional RMSNorm (weight halves w1, w2, fp32), then half-split RoPE with
        one row of the cos/sin tables (`_token_rope`); two halves out."""
        i = tl.arange(0, HALF)
        x1 = tl.load(x_ptr + i).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + i).to(tl.float32)
        if QK_NORM:
            rs = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
            x1 = (w1 * (x1 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as the module path rounds them
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _qk_norm_rope_store(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, qo_ptr,
                            kc_ptr, vc_ptr, eps, s_q, s_k, s_v, s_kc, s_vc, H: tl.constexpr, G: tl.constexpr,
                            HALF: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
                            PRELOAD: tl.constexpr = False):
        """Row strides s_q/s_k/s_v: q, k, v may be column slices of one packed q|k|v projection. cos/sin: RoPE
        tables by position, row pos[t] for token t. The head norm's weight is read before the PDL wait; with
        PRELOAD so are the position, the slot and the cos/sin row (`qk_norm_rope_store`'s `early_pos`)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        DH = 2 * HALF
        i = tl.arange(0, HALF)
        dt = qo_ptr.dtype.element_ty
        w1 = None
        w2 = None
        if QK_NORM:  # (without the norm, qw/kw are placeholders: not read)
            w1 = tl.where(h < H, tl.load(qw_ptr + i), tl.load(kw_ptr + i)).to(tl.float32)
            w2 = tl.where(h < H, tl.load(qw_ptr + HALF + i), tl.load(kw_ptr + HALF + i)).to(tl.float32)
        if PRELOAD:
            slot, c1, c2, s1, s2 = _token_rope(pos_ptr, slots_ptr, cos_ptr, sin_ptr, t, HALF)
        pdl_wait(PDL)
        if not PRELOAD:
            slot, c1, c2, s1, s2 = _token_rope(pos_ptr, slots_ptr, cos_ptr, sin_ptr, t, HALF)
        if h < H:
            o1, o2 = _norm_rope_half(q_ptr + t * s_q + h * DH, w1, w2, c1, c2, s1, s2, eps, HALF, QK_NORM, dt)
            tl.store(qo_ptr + (t * H + h) * DH + i, o1)
            tl.store(qo_ptr + (t * H + h) * DH + HALF + i, o2)
        else:
            g = h - H
            o1, o2 = _norm_rope_half(k_ptr + t * s_k + g * DH, w1, w2, c1, c2, s1, s2, eps, HALF, QK_NORM, dt)
            kc = kc_ptr + slot * s_kc + g * DH
            tl.store(kc + i, o1.to(kc_ptr.dtype.element_ty))
            tl.store(kc + HALF + i, o2.to(kc_ptr.dtype.element_ty))
            vc = vc_ptr + slot * s_vc + g * DH
            tl.store(vc + i, tl.load(v_ptr + t * s_v + g * DH + i).to(vc_ptr.dtype.element_ty))
            tl.store(vc + HALF + i, tl.load(v_ptr + t * s_v + g * DH + HALF + i).to(vc_ptr.dtype.element_ty))

    @triton.jit
    def _weight_rows(w0_ptr, w1_ptr, w2_ptr, start, r, N0: tl.constexpr, N1: tl.constexpr, D: tl.constexpr):
        """Pointers [BLOCK_N, 1] to output rows start + r of [W0; W1; W2] (a block lies in one weight)."""
        if start < N0:
            w_rows = w0_ptr + (start + r).to(tl.int64)[:, None] * D
        elif start < N0 + N1:
            w_rows = w1_ptr + (start - N0 + r).to(tl.int64)[:, None] * D
        else:
            w_rows = w2_ptr + (start - N0 - N1 + r).to(tl.int64)[:, None] * D
        return w_rows

    @triton.jit
    def _row_linear(x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, N0: tl.constexpr, N1: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """One token: out[n] = x . W[n] over the rows of [W0; W1; W2] (N0, N1, then the rest), fp32 accumulation,
        rounded once. A program owns BLOCK_N output rows of one weight (the host checks BLOCK_N divides N0, N1).
        Its first [BLOCK_N, BLOCK_D] weight tile (all of D when BLOCK_D >= D) is read before the PDL wait."""
        pdl_launch_next(PDL, EARLY)
        start = tl.program_id(0) * BLOCK_N
        r = tl.arange(0, BLOCK_N)
        w_rows = _weight_rows(w0_ptr, w1_ptr, w2_ptr, start, r, N0, N1, D)
        d = tl.arange(0, BLOCK_D)
        w = tl.load(w_rows + d[None, :], mask=d[None, :] < D, other=0.0)
        pdl_wait(PDL, EARLY)
        x = tl.load(x_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
        for d0 in range(BLOCK_D, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            xx = tl.load(x_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
            ww = tl.load(w_rows + dd[None, :], mask=dd[None, :] < D, other=0.0).to(tl.float32)
            acc += tl.sum(ww * xx[None, :], 1)
        tl.store(out_ptr + start + r, acc.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _row_linear_router(a_ptr, h_ptr, w_ptr, x_ptr, r_ptr, z_ptr, N: tl.constexpr, A: tl.constexpr, D: tl.constexpr,
                           E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_E: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """One token, o_proj and the router after it in one launch (`ComposedRouter`). Programs below N / BLOCK_N:
        x[n] = h[n] + a . W_o[n] for BLOCK_N rows (the product rounded, then the sum: the module path's o_proj and
        residual add). The others: raw router logits z[e] = a . R[e, :A] + h . R[e, A:] in fp32 for BLOCK_E
        experts. Weights are read before the PDL wait; so is the residual h, written three launches back (the
        q|k|v launch, complete before the q/k norm launch ended and this chain went on)."""
        pdl_launch_next(PDL, EARLY)
        pid = tl.program_id(0)
        c = tl.arange(0, BLOCK_A)
        if pid < N // BLOCK_N:
            n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + n.to(tl.int64)[:, None] * A + c[None, :], mask=c[None, :] < A, other=0.0)
            h_n = tl.load(h_ptr + n).to(tl.float32)
            pdl_wait(PDL, EARLY)
            a = tl.load(a_ptr + c, mask=c < A, other=0.0).to(tl.float32)
            dt = x_ptr.dtype.element_ty
            o = tl.sum(w.to(tl.float32) * a[None, :], 1).to(dt).to(tl.float32)
            tl.store(x_ptr + n, (o + h_n).to(dt))
        else:
            e = (pid - N // BLOCK_N) * BLOCK_E + tl.arange(0, BLOCK_E)
            rows = r_ptr + e.to(tl.int64)[:, None] * (A + D)
            dh = tl.arange(0, BLOCK_D)
            h = tl.load(h_ptr + dh, mask=dh < D, other=0.0).to(tl.float32)
            wh = tl.load(rows + A + dh[None, :], mask=(e[:, None] < E) & (dh[None, :] < D), other=0.0)
            z = tl.sum(wh * h[None, :], 1)
            wa = tl.load(rows + c[None, :], mask=(e[:, None] < E) & (c[None, :] < A), other=0.0)
            pdl_wait(PDL, EARLY)
            a = tl.load(a_ptr + c, mask=c < A, other=0.0).to(tl.float32)
            tl.store(z_ptr + e, z + tl.sum(wa * a[None, :], 1), mask=e < E)

    @triton.jit
    def _norm_row_linear(x_ptr, res_ptr, nw_ptr, y_ptr, res_out_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, eps,
                         N0: tl.constexpr, N1: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, WRITE_Y: tl.constexpr, EARLY: tl.constexpr,
                         PDL: tl.constexpr, EMBED: tl.constexpr = False):
        """`_row_linear` of y = RMSNorm(res + x) (no res: RMSNorm(x)), which every program computes from the whole
        row (BLOCK_D >= D) with `_add_rmsnorm`'s rounding points; program 0 also stores res + x (and y, WRITE_Y)
        for the kernels after. Its weight tile and the norm weight are read before the PDL wait.
        EMBED (no res): x is row res_ptr[0] (the token id) of the embedding table at x_ptr, and program 0 stores
        it into res_out: the embedding lookup of the first layer, without a launch of its own."""
        pdl_launch_next(PDL, EARLY)
        pid = tl.program_id(0)
        start = pid * BLOCK_N
        r = tl.arange(0, BLOCK_N)
        w_rows = _weight_rows(w0_ptr, w1_ptr, w2_ptr, start, r, N0, N1, D)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        w = tl.load(w_rows + d[None, :], mask=ok[None, :], other=0.0)
        nw = tl.load(nw_ptr + d, mask=ok, other=0.0).to(tl.float32)
        pdl_wait(PDL, EARLY)
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
        acc = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], 1)
        tl.store(out_ptr + start + r, acc.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _softmax_topk_store(z, t, t_ok, e, ids_ptr, wts_ptr, scale, K: tl.constexpr, NORM: tl.constexpr):
        """Rows t of fp32 router logits z [BLOCK_T, E_PAD] (padding -inf): softmax, the top K (lowest expert id
        among ties) into ids/wts [T, K], renormalised when NORM, times `scale` (`Router._route_softmax`)."""
        p = tl.exp(z - tl.max(z, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        total = tl.zeros_like(tl.max(p, 1))
        for k in tl.static_range(K):  # k-th largest (lowest id among ties), then masked out
            best = tl.max(p, 1)
            idx = tl.min(tl.where(p == best[:, None], e[None, :], e.shape[0]), 1)
            idx = tl.where(idx < e.shape[0], idx, 0)  # a NaN row matches nothing: expert 0, not a read out of bounds
            tl.store(ids_ptr + t * K + k, idx.to(tl.int64), mask=t_ok)
            tl.store(wts_ptr + t * K + k, best, mask=t_ok)
            total += best
            p = tl.where(e[None, :] == idx[:, None], -1.0, p)
        for k in tl.static_range(K):
            w_k = tl.load(wts_ptr + t * K + k, mask=t_ok, other=0.0)
            tl.store(wts_ptr + t * K + k, (w_k / total if NORM else w_k) * scale, mask=t_ok)

    @triton.jit
    def _softmax_topk(logits_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                      NORM: tl.constexpr, PDL: tl.constexpr):
        """Program t: one token's routing from its logits row."""
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
        e = tl.arange(0, E_PAD)
        z = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=e[None, :] < E, other=float("-inf")).to(tl.float32)
        _softmax_topk_store(z, t, t >= 0, e, ids_ptr, wts_ptr, scale, K, NORM)

    @triton.jit
    def _router_topk(x_ptr, w_ptr, ids_ptr, wts_ptr, scale, T, part_ptr, done_ptr, D: tl.constexpr,
                     E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, D_SPLIT: tl.constexpr,
                     PDL: tl.constexpr):
        """Tokens [p * BLOCK_T, (p + 1) * BLOCK_T): router logits x @ W.T (fp32 accumulation, rounded to x's dtype
        as the module's F.linear output), then `_softmax_topk`'s routing (one launch, not two).
        SPLITS > 1: program (p, s) sums columns [s * D_SPLIT, (s + 1) * D_SPLIT) only (a 1/SPLITS share of the
        router's weight: a few programs streaming all of it are latency-bound), stores its fp32 partial logits in
        part [SPLITS, tiles, BLOCK_T, E_PAD], and the tile's last program to finish (`last_arrival` on done[p]) adds
        the SPLITS partials in split order and routes. (The add + RMSNorm before it folded in here, each program
        summing its rows' squares itself, measured 2.3 us per layer slower on the H200: BENCHMARKS.md, session 17.)"""
        pdl_wait(PDL)
        p = tl.program_id(0)
        t = p.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        e = tl.arange(0, E_PAD)
        split = tl.program_id(1)
        acc = tl.zeros([BLOCK_T, E_PAD], tl.float32)
        for d0 in range(0, D_SPLIT, BLOCK_D):  # (from 0: the interpreter cannot start a loop at a program id)
            d = split * D_SPLIT + d0 + tl.arange(0, BLOCK_D)
            d_ok = (d < D) & (d < (split + 1) * D_SPLIT)
            m = t_ok[:, None] & d_ok[None, :]
            x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=m, other=0.0)
            w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=(e[:, None] < E) & d_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        routes = True  # this program routes its tokens: the only one, or the tile's last to finish
        if SPLITS > 1:
            tile = part_ptr + t[:, None] * E_PAD + e[None, :]
            stride = tl.num_programs(0).to(tl.int64) * BLOCK_T * E_PAD
            tl.store(tile + split * stride, acc)
            routes = last_arrival(done_ptr + p, SPLITS)
            if routes:
                acc = tl.load(tile, cache_modifier=".cg")
                for j in tl.static_range(1, SPLITS):
                    acc += tl.load(tile + j * stride, cache_modifier=".cg")
        if routes:
            z = tl.where(e[None, :] < E, acc.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
            _softmax_topk_store(z, t, t_ok, e, ids_ptr, wts_ptr, scale, K, NORM)

def fused_supported(model: nn.Module) -> bool:
    """GQA attention with half-split RoPE over the whole head, softmax routers, SiLU experts, no shared experts."""
    cfg = model.cfg
    if triton is None or cfg.is_mla or model.rotary.interleaved or cfg.rope_dim != cfg.head_dim:
        return False
    if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 4:  # power-of-two halves for tl.arange
        return False
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE) and (layer.mlp.gate.scoring_func != "softmax" or hasattr(layer.mlp, "shared_experts")):
            return False
    return True


def add_rmsnorm(x_TD: torch.Tensor, res_TD: torch.Tensor | None, norm: RMSNorm,
                combine: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(res + x), res + x); with res None: (RMSNorm(x), x). With `combine` = (dest_TK, weights_TK), x is
    rows of expert outputs [S, D] and the added term is sum_k weights[t, k] * x[dest[t, k]] (rounded first)."""
    T, D = x_TD.shape if combine is None else (combine[0].shape[0], x_TD.shape[1])
    y_TD = x_TD.new_empty(T, D)
    res_out = x_TD if res_TD is None else torch.empty_like(y_TD)
    dest, wts = combine if combine is not None else (x_TD, x_TD)
    _add_rmsnorm[(T,)](x_TD, x_TD if res_TD is None else res_TD, norm.weight, y_TD, res_out, dest, wts, norm.eps, D=D,
                       BLOCK_D=triton.next_power_of_2(D), HAS_RES=res_TD is not None,
                       COMBINE_K=0 if combine is None else combine[0].shape[1], num_warps=4, **pdl_args(x_TD, T))
    return y_TD, res_out


# the q/k norm launch reads the position, slot and cos/sin row before its PDL wait in every layer after the first,
# one dependent read fewer after it. H200, reference model, B=1: engine.step 2.900-2.904 ms per 8 steps against
# 2.971-2.973 in the same call (BENCHMARKS.md, session 23); MOELOOP_QK_PRELOAD=off reads them after the wait
QK_PRELOAD = os.environ.get("MOELOOP_QK_PRELOAD", "on").lower() != "off"


def qk_norm_rope_store(attn: nn.Module, q_TX: torch.Tensor, k_TX: torch.Tensor, v_TX: torch.Tensor,
                       rope: RopeTables, pos_T: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots_T: torch.Tensor, early_pos: bool = False) -> torch.Tensor:
    """Normalised, rotated q [T, H, Dh]; k (normalised, rotated) and v written to their cache slots. `rope`: tables
    by position (`RotaryEmbedding.table`), read at rows pos_T. `early_pos` (with `QK_PRELOAD`): pos_T, slots_T and
    the cos/sin rows are read before the PDL wait; only where a kernel launched after their writer (the sampler)
    and before this one triggered late: every layer after the first (the q/k norm launch before it)."""
    T = q_TX.shape[0]
    H, G, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_out = q_TX.new_empty(T, H, Dh)
    qk_norm = hasattr(attn, "q_norm")
    qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if qk_norm else (q_TX, q_TX)
    eps = attn.q_norm.eps if qk_norm else 0.0
    q_TX, k_TX, v_TX = (x if x.stride(1) == 1 else x.contiguous() for x in (q_TX, k_TX, v_TX))
    cos_PR, sin_PR = rope.cos_TR.contiguous(), rope.sin_TR.contiguous()
    _qk_norm_rope_store[(T, H + G)](q_TX, k_TX, v_TX, qw, kw, cos_PR, sin_PR, pos_T, slots_T, q_out,
                                    k_cache, v_cache, eps, q_TX.stride(0), k_TX.stride(0), v_TX.stride(0),
                                    k_cache.stride(0), v_cache.stride(0), H=H, G=G, HALF=Dh // 2,
                                    QK_NORM=qk_norm, PRELOAD=QK_PRELOAD and early_pos, num_warps=1,
                                    enable_fp_fusion=False, **pdl_args(q_TX, T))
    # (no FMA: LLVM lowers each bf16 round trip to a bf16 mul and add, and fusing them would skip the rounding of
    # the RoPE products that the module path and the trainer's rope kernel keep)
    return q_out


ROW_LINEAR = True  # a one-token decode (B=1) runs its projections as `_row_linear` launches instead of cuBLAS GEMVs
# rows per program and warps: small tiles, many programs (H200, reference shapes: picked alone by
# `benchmarks/b1_gemv.py`, then in the engine's B=1 graph by `benchmarks/b1_tiles.py`: 4 warps, session 12).
# Session 26, with the composed o_proj launch on its own tile: 8 rows, 4 warps ("row_linear=(8, 4) 0.3384 ms, +1.5 us
# per forward" in `b1_tiles.py`; rollout.py B=1 engine.step 2.839/2.843 against 2.861/2.857 ms per 8 steps at (4, 4),
# alternating). MOELOOP_ROW_LINEAR_TILE=rows,warps for A/Bs
ROW_LINEAR_TILE = kernel_switch.env_tile("MOELOOP_ROW_LINEAR_TILE", (8, 4))
ROW_LINEAR_MAX_D = ROW_MAX_D  # weight columns a program holds at once (the whole row up to this width)
# the router's norm-folded projection (64 rows at the reference shape), a latency-bound hop: 4 rows and 4 warps per
# program; (4, 1), (4, 2), (2, 1), (1, 1) and (16, 4) measured 2-12 us per B=1 forward slower (BENCHMARKS.md, session 15)
ROUTER_TILE = kernel_switch.env_tile("MOELOOP_ROUTER_TILE", (4, 4))


def row_linear_applies(x_TD: torch.Tensor, linears: list[nn.Module], block_n: int) -> bool:
    """One token, bias-free weights of x's dtype and width, output rows a multiple of `block_n` per weight."""
    return (ROW_LINEAR and x_TD.shape[0] == 1 and len(linears) <= 3 and x_TD.is_contiguous()
            and all(getattr(m, "bias", None) is None and m.weight.dtype == x_TD.dtype and m.weight.shape[1] == x_TD.shape[1]
                    and m.weight.shape[0] % block_n == 0 and m.weight.is_contiguous() for m in linears))


def row_linear(x_TD: torch.Tensor, linears: list[nn.Module], block_n: int) -> torch.Tensor:
    """[1, N0 + N1 + N2]: x through up to three bias-free projections in one launch (`_row_linear`)."""
    out, ws, sizes = _stacked_rows(x_TD, linears)
    _row_linear[(out.shape[1] // block_n,)](x_TD, *ws, out, N0=sizes[0], N1=sizes[1], D=x_TD.shape[1], BLOCK_N=block_n,
                                             BLOCK_D=min(ROW_LINEAR_MAX_D, triton.next_power_of_2(x_TD.shape[1])),
                                             EARLY=kernel_switch.PDL_EARLY, num_warps=ROW_LINEAR_TILE[1],
                                             **pdl_args(x_TD, 1))
    return out


def _stacked_rows(x_TD: torch.Tensor, linears: list[nn.Module]) -> tuple[torch.Tensor, list, list[int]]:
    """A one-token launch's output [1, N0 + N1 + N2], its three weights (the last repeated when fewer) and the
    row counts (N0, N1: 0 when absent, then N2)."""
    ws = [m.weight for m in linears]
    sizes = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    return x_TD.new_empty(1, sum(sizes)), ws + [ws[-1]] * (3 - len(ws)), sizes


# B=1: the add + RMSNorm before a one-token projection folded into it (`_norm_row_linear`), two fewer
# single-program launches per layer; MOELOOP_NORM_FOLD=off turns it off
NORM_FOLD = os.environ.get("MOELOOP_NORM_FOLD", "on").lower() != "off"


def norm_fold_applies(x_TD: torch.Tensor, linears: list[nn.Module], block_n: int | None = None) -> bool:
    return (NORM_FOLD and row_linear_applies(x_TD, linears, ROW_LINEAR_TILE[0] if block_n is None else block_n)
            and triton.next_power_of_2(x_TD.shape[1]) <= ROW_LINEAR_MAX_D)


def normed_row_linear(x_TD: torch.Tensor, res_TD: torch.Tensor | None, norm: RMSNorm, linears: list[nn.Module],
                      want_y: bool = False, ids_T: torch.Tensor | None = None, tile: tuple[int, int] | None = None
                      ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(the projections of y = RMSNorm(res + x) through `linears`, y if want_y, res + x) in one launch: what
    `add_rmsnorm` then `project` give (up to the norm's fp32 summation order). With `ids_T` (one token id, no res),
    x_TD is the embedding table and x its row ids_T[0] (`embed_fold_applies`). `tile`: (rows per program, warps),
    default ROW_LINEAR_TILE."""
    (block_n, warps), D = tile or ROW_LINEAR_TILE, x_TD.shape[1]
    out, ws, sizes = _stacked_rows(x_TD, linears)
    y_TD = x_TD.new_empty(1, D) if want_y else out
    if ids_T is not None:
        res_out, res_in = x_TD.new_empty(1, D), ids_T
    else:
        res_out = x_TD if res_TD is None else torch.empty_like(x_TD)
        res_in = x_TD if res_TD is None else res_TD
    _norm_row_linear[(out.shape[1] // block_n,)](x_TD, res_in, norm.weight, y_TD, res_out,
                                                  *ws, out, norm.eps, N0=sizes[0], N1=sizes[1], D=D, BLOCK_N=block_n,
                                                  BLOCK_D=triton.next_power_of_2(D), HAS_RES=res_TD is not None,
                                                  WRITE_Y=want_y, EARLY=kernel_switch.PDL_EARLY,
                                                  EMBED=ids_T is not None, num_warps=warps,
                                                  **pdl_args(x_TD, 1))
    return list(out.split(sizes[:len(linears)], dim=1)), y_TD if want_y else None, res_out


# B=1 with `decode_packs.ROUTER_COMPOSE`: o_proj and the composed router's raw logits in one launch (`o_proj_router`);
# router rows per program of that launch: 1, 2 and 4 measured 2.926, 2.935-2.940 and 2.965 ms per 8 steps (H200)
ROUTER_COMPOSE_ROWS = kernel_switch.env_tile("MOELOOP_ROUTER_COMPOSE_ROWS", (1,))[0]
# (o_proj rows per program, warps) of that launch: 2 rows, 2 warps. It shared q|k|v's ROW_LINEAR_TILE (4, 4) until
# session 25, which measured (4, 2) (H200, `b1_tiles.py` "o_proj=(4, 2) 0.3395 ms, +1.4 us per forward"; rollout.py B=1
# engine.step 2.858/2.858 against 2.866/2.866 ms per 8 steps). Session 26, q|k|v at (8, 4): "o_proj=(2, 2) 0.3390 ms,
# +1.5 us per forward"; engine.step 2.819/2.824/2.821 against 2.837/2.836/2.837 at (4, 2), alternating.
# MOELOOP_O_PROJ_TILE=rows,warps for A/Bs
O_PROJ_TILE = kernel_switch.env_tile("MOELOOP_O_PROJ_TILE", (2, 2))


def composed_router(layer: nn.Module, o_TD: torch.Tensor, res_TD: torch.Tensor | None) -> ComposedRouter | None:
    """The layer's `ComposedRouter` when this one-token step can take it: `ROUTER_COMPOSE` on, packed
    (`pack_routers`), a residual to add, o_proj a one-token row launch, the expert kernels ranking the logits."""
    pack = layer.mlp.__dict__.get("_decode_router") if decode_packs.ROUTER_COMPOSE else None
    if pack is None or res_TD is None or not res_TD.is_contiguous() or res_TD.dtype != o_TD.dtype:
        return None
    ok = row_linear_applies(o_TD, [layer.self_attn.o_proj], O_PROJ_TILE[0]) and composed_applies(res_TD, layer.mlp)
    return pack if ok else None


def o_proj_router(o_TD: torch.Tensor, res_TD: torch.Tensor, pack: ComposedRouter) -> tuple[torch.Tensor, torch.Tensor]:
    """(x = res + o_proj(o) [1, D], the raw composed router logits [1, E] fp32) in one launch (`_row_linear_router`)."""
    w = pack.o_proj.weight
    (D, A), E = w.shape, pack.weight.shape[0]
    x_TD = res_TD.new_empty(1, D)
    z_TE = torch.empty(1, E, dtype=torch.float32, device=res_TD.device)
    block_n, warps = O_PROJ_TILE
    grid = D // block_n + triton.cdiv(E, ROUTER_COMPOSE_ROWS)
    _row_linear_router[(grid,)](o_TD, res_TD, w, x_TD, pack.weight, z_TE, N=D, A=A, D=res_TD.shape[1], E=E,
                                BLOCK_N=block_n, BLOCK_A=triton.next_power_of_2(A),
                                BLOCK_D=triton.next_power_of_2(res_TD.shape[1]), BLOCK_E=ROUTER_COMPOSE_ROWS,
                                EARLY=kernel_switch.PDL_EARLY, num_warps=warps, **pdl_args(o_TD, 1))
    return x_TD, z_TE


# B=1: the first layer's q|k|v launch reads the token's embedding row itself (`normed_row_linear` with ids), one
# launch fewer per step; MOELOOP_EMBED_FOLD=off runs the embedding lookup first
EMBED_FOLD = os.environ.get("MOELOOP_EMBED_FOLD", "on").lower() != "off"


def embed_fold_applies(embed: nn.Module, ids_T: torch.Tensor, linears: list[nn.Module]) -> bool:
    """One token through a plain embedding table (contiguous, int ids) into a norm-folded projection."""
    table = embed.weight
    return (EMBED_FOLD and ids_T.numel() == 1 and type(embed) is nn.Embedding and embed.max_norm is None
            and table.is_contiguous() and not ids_T.is_floating_point() and norm_fold_applies(table[:1], linears))


def decode_weights_apply(model: nn.Module) -> bool:
    """The engine's CUDA decode takes the fused forward here (so `decode_packs.derive_decode_weights` pays off)."""
    return kernels_apply(next(model.parameters())) and fused_supported(model)


def project_qkv(x_TD: torch.Tensor, attn: nn.Module) -> list[torch.Tensor]:
    """q, k, v of x: one `_row_linear` launch for a single token, one GEMM on the layer's `QKVPack` (column
    slices of its output) for more, else three GEMMs."""
    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
    pack = attn.__dict__.get("_decode_qkv")
    if pack is None or row_linear_applies(x_TD, linears, ROW_LINEAR_TILE[0]):
        return project(x_TD, linears)
    return list(F.linear(x_TD, pack.weight, pack.bias).split(pack.sizes, dim=1))


def project(x_TD: torch.Tensor, linears: list[nn.Module], block_n: int | None = None) -> list[torch.Tensor]:
    """x @ W.T (+ bias) for each module's `weight` (nn.Linear, or the router): one `_row_linear` launch for a
    single token when it applies (`block_n` rows per program, default ROW_LINEAR_TILE's), else one F.linear each."""
    block_n = ROW_LINEAR_TILE[0] if block_n is None else block_n
    if row_linear_applies(x_TD, linears, block_n):
        return list(row_linear(x_TD, linears, block_n).split([m.weight.shape[0] for m in linears], dim=1))
    return [F.linear(x_TD, m.weight, getattr(m, "bias", None)) for m in linears]


ROUTER_FUSED_MIN_TOKENS = 16  # from this many tokens the router GEMM runs inside the top-k kernel (tl.dot tiles)
# `_router_topk`'s (BLOCK_T tokens per program, BLOCK_D columns per step, warps, stages): H200, reference shape,
# one launch 6.02 / 6.07 / 6.12 us at 32 / 128 / 256 tokens against 6.38 / 6.61 / 6.64 with BLOCK_D 128, the same
# ids and weights (`benchmarks/router_topk.py`, BLOCK_T 16-32, BLOCK_D 128-512, 4-8 warps, 2-4 stages)
ROUTER_TOPK_TILE = (16, 256, 4, 3)
# programs per token tile, each summing 1/ROUTER_TOPK_SPLITS of the hidden dim (`_router_topk`; 1: one program
# streams the whole router weight per tile). H200, reference shape, alone: 4.39-4.53 us against 5.98-6.19 with one,
# the same ids; the decode forward graph B=128 2.214 against 2.248 ms, B=256 2.728 against 2.756-2.761 (two rounds,
# BENCHMARKS.md session 16). MOELOOP_ROUTER_SPLITS for A/Bs
ROUTER_TOPK_SPLITS = int(os.environ.get("MOELOOP_ROUTER_SPLITS", "6"))


def route_applies(moe: MoE, x_TD: torch.Tensor) -> bool:
    """The one-launch router (`_router_topk`): at least ROUTER_FUSED_MIN_TOKENS tokens, a bias-free contiguous
    router weight of x's dtype."""
    w = moe.gate.weight
    return (bool(ROUTER_FUSED_MIN_TOKENS) and x_TD.shape[0] >= ROUTER_FUSED_MIN_TOKENS and w.dtype == x_TD.dtype
            and w.is_contiguous() and x_TD.is_contiguous())


def route(moe: MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K], weights [T, K]) of x's tokens: one `_router_topk` launch for a batch of at least
    ROUTER_FUSED_MIN_TOKENS tokens (`route_applies`), else the projection (`project`) and `_softmax_topk`."""
    router, (T, D) = moe.gate, x_TD.shape
    if not route_applies(moe, x_TD):
        (logits_TE,) = project(x_TD, [router])
        return route_softmax_topk(moe, logits_TE)
    w = router.weight
    E, K = w.shape[0], router.top_k
    ids_TK = torch.empty(T, K, dtype=torch.int64, device=x_TD.device)
    wts_TK = torch.empty(T, K, dtype=torch.float32, device=x_TD.device)
    block_t, block_d, warps, stages = ROUTER_TOPK_TILE
    block_d = min(block_d, triton.next_power_of_2(D))
    tiles, e_pad = triton.cdiv(T, block_t), max(16, triton.next_power_of_2(E))
    splits = max(1, min(ROUTER_TOPK_SPLITS, triton.cdiv(D, block_d)))
    d_split = triton.cdiv(triton.cdiv(D, splits), block_d) * block_d
    if splits > 1:
        part = x_TD.new_empty(splits * tiles * block_t * e_pad, dtype=torch.float32)
        done = row_counters(x_TD.device, tiles)
    else:
        part = done = wts_TK  # (unused)
    _router_topk[(tiles, splits)](x_TD, w, ids_TK, wts_TK, float(router.routed_scaling_factor), T, part, done,
                                  D=D, E=E, E_PAD=e_pad, K=K, NORM=bool(router.norm_topk_prob), BLOCK_T=block_t,
                                  BLOCK_D=block_d, PRECISION="ieee" if x_TD.dtype == torch.float32 else "tf32",
                                  SPLITS=splits, D_SPLIT=d_split, num_warps=warps, num_stages=stages,
                                  **pdl_args(x_TD, T))
    return ids_TK, wts_TK


def route_softmax_topk(moe: MoE, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] int64, weights [T, K] fp32) exactly as `Router._route_softmax` (ties: lowest expert id).
    (A router GEMV fused in here, one program per token, measured 19 us per layer at B=1 on the H200: slower
    than cuBLAS's GEMV plus this kernel.)"""
    T, E = logits_TE.shape
    router = moe.gate
    ids_TK = torch.empty(T, router.top_k, dtype=torch.int64, device=logits_TE.device)
    wts_TK = torch.empty(T, router.top_k, dtype=torch.float32, device=logits_TE.device)
    logits_TE = logits_TE.contiguous()
    _softmax_topk[(T,)](logits_TE, ids_TK, wts_TK, float(router.routed_scaling_factor), E=E,
                        E_PAD=triton.next_power_of_2(E), K=router.top_k, NORM=bool(router.norm_topk_prob),
                        num_warps=1, **pdl_args(logits_TE, T))
    return ids_TK, wts_TK


# B=1: the final add + RMSNorm folded into the lm_head's one-token projection (`_norm_row_linear` over the vocab
# rows, LM_HEAD_TILE rows per program) instead of `_add_rmsnorm` then cuBLAS; MOELOOP_LM_HEAD_FOLD=off turns it off
LM_HEAD_FOLD = os.environ.get("MOELOOP_LM_HEAD_FOLD", "on").lower() != "off"
# (rows per program, warps) of the folded lm_head (`benchmarks/b1_tiles.py`); MOELOOP_LM_HEAD_TILE=rows,warps
LM_HEAD_TILE = kernel_switch.env_tile("MOELOOP_LM_HEAD_TILE", (4, 4))


def fused_decode_logits(model: nn.Module, ids_T: torch.Tensor, pos_T: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
    """Logits [T, V] of a decode-only batch: `fused_decode_forward` then the lm_head, with the final norm folded
    into a one-token lm_head (`LM_HEAD_FOLD`; the same rounding points, another fp32 summation order)."""
    pending = _decode_layers(model, ids_T, pos_T, ctx)
    head = model.lm_head
    if (LM_HEAD_FOLD and pending[2] is not None and isinstance(head, nn.Linear)
            and norm_fold_applies(pending[0], [head], LM_HEAD_TILE[0])):
        (logits_TV,), _, _ = normed_row_linear(*pending, [head], tile=LM_HEAD_TILE)
        return logits_TV
    return model.compute_logits(_settle(pending)[0])


def fused_decode_forward(model: nn.Module, ids_T: torch.Tensor, pos_T: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
    """Hidden states [T, D] after the final norm for a decode-only batch (one new token per sequence)."""
    return _settle(_decode_layers(model, ids_T, pos_T, ctx))[0]


def _decode_layers(model: nn.Module, ids_T: torch.Tensor, pos_T: torch.Tensor, ctx: PagedAttention) -> tuple:
    """The decode-only batch (one new token per sequence) through every layer -> the pending (x, res, final norm)
    whose add + RMSNorm gives the hidden states (norm None: the last weighted sum ran it, and x is them).
    `pending` = (x, res, norm): the add + RMSNorm that the next projection applies (`_settle` runs it alone).
    PDL triggers (`kernel_switch`): the projections, the paged decode, its merge and the expert down kernel let the
    next kernel launch at their start (`PDL_EARLY`); three kernels trigger late, after their wait, because a later
    kernel reads before its own wait what was written before them: the q/k norm + RoPE store (the paged decode
    reads the lengths, block tables and cached K/V; with `QK_PRELOAD` the next layer's q/k norm launch reads the
    positions and slots), the top-k (gate_up would see the router's logits) and gate_up (the down kernel reads the
    expert ids, or with `ROUTE_FOLD` the router's logits)."""
    stack = model.model
    layers = stack.layers
    table = stack.embed_tokens.weight
    # RoPE tables by position, built once (the warm-up before a graph capture): the step reads rows, no table ops
    rope = model.rotary.table(ctx.meta.block_tables_BN.shape[1] * ctx.cache.block_size, table.dtype, table.device)
    a0 = layers[0].self_attn
    embed_fold = embed_fold_applies(stack.embed_tokens, ids_T, [a0.q_proj, a0.k_proj, a0.v_proj])
    pending = (None if embed_fold else stack.embed_tokens(ids_T), None, layers[0].input_layernorm)
    slots_T = ctx.meta.slot_mapping_T
    T = ids_T.shape[0]
    routes = ctx.routes  # rollout.record_routes: every MoE layer's expert ids in memory, written at the slots
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        linears = [attn.q_proj, attn.k_proj, attn.v_proj]
        if i == 0 and embed_fold:
            (q_TX, k_TX, v_TX), _, res_TD = normed_row_linear(table, None, pending[2], linears, ids_T=ids_T)
        elif pending[2] is not None and norm_fold_applies(pending[0], linears):
            (q_TX, k_TX, v_TX), _, res_TD = normed_row_linear(*pending, linears)
        else:
            y_TD, res_TD = _settle(pending)
            q_TX, k_TX, v_TX = project_qkv(y_TD, attn)
        q_THD = qk_norm_rope_store(attn, q_TX, k_TX, v_TX, rope, pos_T, ctx.cache.k[i], ctx.cache.v[i],
                                   slots_T, early_pos=i > 0)
        attn_TA = ctx.attend_cached(i, q_THD, attn.scale).reshape(T, -1)
        mlp = layer.mlp
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else stack.norm
        composed = composed_router(layer, attn_TA, res_TD) if routes is None else None  # (its ids stay in-kernel)
        if composed is not None:  # o_proj, the residual add and the raw router logits in one launch
            x_TD, z_TE = o_proj_router(attn_TA, res_TD, composed)
            pending = (routed_experts(mlp, x_TD, z_TE, layer.post_attention_layernorm), x_TD, norm)
            continue
        (o_TD,) = project(attn_TA, [attn.o_proj])
        pending = (o_TD, res_TD, layer.post_attention_layernorm)
        if not isinstance(mlp, MoE):
            y_TD, res_TD = add_rmsnorm(*pending)
            pending = (mlp(y_TD), res_TD, norm)
            continue
        if norm_fold_applies(o_TD, [mlp.gate], ROUTER_TILE[0]):  # the router's projection applies the norm, stores y
            (logits_TE,), y_TD, res_TD = normed_row_linear(*pending, [mlp.gate], want_y=True, tile=ROUTER_TILE)
            if routes is None and routed_experts_apply(y_TD, mlp):  # the expert kernels rank the logits themselves
                pending = (routed_experts(mlp, y_TD, logits_TE), res_TD, norm)
                continue
            ids_TK, wts_TK = route_softmax_topk(mlp, logits_TE)
        else:
            y_TD, res_TD = add_rmsnorm(*pending)
            ids_TK, wts_TK = route(mlp, y_TD)
        if routes is not None:
            routes.record(mlp.moe_index, ids_TK)
        if uses_grouped_rows(y_TD, ids_TK):  # the weighted sum of the expert rows happens in the add + norm
            rows_SD, dest_S = grouped_expert_rows(mlp.experts, y_TD, ids_TK)
            y_TD, res_TD = add_rmsnorm(rows_SD, res_TD, norm, (dest_S.view(ids_TK.shape), wts_TK))
            pending = (y_TD, res_TD, None)
        else:
            pending = (fused_experts(mlp.experts, y_TD, ids_TK, wts_TK), res_TD, norm)
    return pending


def _settle(pending: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, res) of a pending (x, res, norm): the add + RMSNorm run alone (norm None: x is y already)."""
    x_TD, res_TD, norm = pending
    return (x_TD, res_TD) if norm is None else add_rmsnorm(x_TD, res_TD, norm)
