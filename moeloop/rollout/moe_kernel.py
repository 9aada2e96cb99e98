"""Fused Triton MoE for decode: the engine's `Experts` implementation "rollout_decode" on CUDA.

Few tokens (T*K <= `FUSED_MAX_ASSIGNMENTS`) run two kernels with no sort: gate_up + SiLU*up per assignment,
then down + the weighted sum over the K experts of each token. More tokens take the grouped path (each
expert's weights read once): one kernel orders the assignments by expert (a stable counting sort: the same
order as `Experts.sorted_forward`'s stable argsort, without the radix sort's kernels), two grouped GEMMs,
and one kernel for the weighted sum over each token's K rows. The grouped GEMMs are Triton kernels
(`_expert_gemm`: one program per (expert, output tile), streaming that tile of the expert's weights once
past all of its rows; the first reads its rows straight from the tokens and fuses SiLU*up), or
`grouped_mm` when `GROUPED_GEMM = "grouped_mm"`. All free of host syncs, so they can be captured in a CUDA
graph. Rounding points follow `Experts`.
"""
# T tokens, D model dim, F expert ffn dim, K experts per token, S = T*K assignments
from __future__ import annotations

import os
from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import nn

from moeloop.model.expert_rows import combine
from moeloop.model import kernel_switch
from moeloop.model.kernel_switch import pdl_args
from moeloop.model.experts import Experts, expert_counts, register_experts_impl
from moeloop.model.moe import MoE
from moeloop.rollout.decode_kernel import triton, triton_interpreting

FUSED_MAX_ASSIGNMENTS = 32
# few-token kernels' tiles (H200, reference shapes, `benchmarks/b1_gemv.py` alone, then `benchmarks/b1_tiles.py`
# in the engine's B=1 graph: gate_up 8 rows and 4 warps, session 12): gate_up (BLOCK_F, warps) and down
# (BLOCK_D, warps); each program holds up to FEW_MAX_WIDTH weight columns at once
GATE_UP_FEW_TILE = kernel_switch.env_tile("MOELOOP_GATE_UP_FEW_TILE", (8, 4))
DOWN_FEW_TILE = kernel_switch.env_tile("MOELOOP_DOWN_FEW_TILE", (4, 4))
FEW_MAX_WIDTH = 2048
GROUPED_GEMM = "triton"  # or "grouped_mm" (torch's cutlass kernel; bf16 only)
# `_expert_gemm` tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages) for the gate_up and down launches
GATE_UP_TILE = (64, 128, 4, 3)
DOWN_TILE = (64, 128, 4, 3)
BLOCK_M_SLACK = 2
# programs per (expert, weight tile), each taking every M_SPLITS-th row chunk: routing in RL is skewed (the n
# samples of a prompt pick alike), and one expert's rows looping in one program set the kernel's time
M_SPLITS = int(os.environ.get("MOELOOP_MOE_M_SPLITS", "4"))
ALIGN_MAX_ASSIGNMENTS = 8192  # the counting sort holds all assignments in one program; a long prefill sorts instead
IMPL_NAME = "rollout_decode"

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait
    # SiLU as torch's CUDA kernel computes it (libdevice expf, IEEE division): the trainer's swiglu kernel does the
    # same, so rollout and training activations round alike
    from moeloop.model.swiglu_kernel import _silu

    @triton.jit
    def _rms_scale(x, eps, D: tl.constexpr):
        """1 / RMS of one row x (padding 0), in fp32."""
        x = x.to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, 0) / D + eps)

    @triton.jit
    def _rmsnorm_row(x, w, eps, D: tl.constexpr, dt: tl.constexpr):
        """RMSNorm of one row x (dt values, padding 0) with weight w (fp32) -> dt, rounded where the module path
        rounds (the normed row, then the weight product)."""
        normed = (x.to(tl.float32) * _rms_scale(x, eps, D)).to(dt).to(tl.float32)
        return (w * normed).to(dt)

    @triton.jit
    def _ranked_experts(logits_ptr, t, slot, E: tl.constexpr, E_PAD: tl.constexpr, SCALED: tl.constexpr = False,
                        rs=1.0, dt: tl.constexpr = tl.float32):
        """(ids, z, rank): the experts at ranks `slot` (a tensor) of token t's router logits [T, E]; z, the logits
        [E_PAD] in fp32 (padding -inf); rank, each expert's rank. The order is logit descending, lowest id among
        ties: `_softmax_topk_store`'s order on their softmax, which the exp keeps (it could tie two logits only by
        rounding both to one probability). A slot no expert holds (a NaN row) reads expert 0.
        A composed router's raw logits (`decode_packs.ComposedRouter`, fp32) rank as they are: a positive scale
        keeps the order, so the ids do not wait for the 1 / RMS. SCALED: z is then raw * rs (1 / RMS of the token's
        residual row) rounded to dt, where the module path rounds its logits, for the routing weights."""
        i = tl.arange(0, E_PAD)
        z = tl.load(logits_ptr + t * E + i, mask=i < E, other=float("-inf")).to(tl.float32)
        beats = (z[None, :] > z[:, None]) | ((z[None, :] == z[:, None]) & (i[None, :] < i[:, None]))
        rank = tl.sum(beats.to(tl.int32), 1)
        ids = tl.min(tl.where(rank[None, :] == slot[:, None], i[None, :], E_PAD), 1)
        if SCALED:
            z = (z * rs).to(dt).to(tl.float32)
        return tl.where(ids < E, ids, 0), z, rank

    @triton.jit
    def _routed_weights(z, rank, ids, scale, K: tl.constexpr, NORM: tl.constexpr):
        """Routing weights of experts `ids` (a tensor) from `_ranked_experts`' z and rank: softmax probability,
        divided by the sum of the top K's (added in rank order) when NORM, times `scale` (`_softmax_topk_store`)."""
        p = tl.exp(z - tl.max(z, 0))
        p = p / tl.sum(p, 0)
        total = tl.sum(tl.where(rank == 0, p, 0.0), 0)
        for kk in tl.static_range(1, K):
            total += tl.sum(tl.where(rank == kk, p, 0.0), 0)
        i = tl.arange(0, z.shape[0])
        best = tl.sum(tl.where(i[None, :] == ids[:, None], p[None, :], 0.0), 1)
        return (best / total if NORM else best) * scale

    @triton.jit
    def _gate_up_silu(x_ptr, w_ptr, ids_ptr, h_ptr, s_we, s_wf, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
                      ROUTED: tl.constexpr = False, E: tl.constexpr = 1, E_PAD: tl.constexpr = 1,
                      COMPOSED: tl.constexpr = False, nw_ptr=None, eps=0.0):
        """Program (s, f): gate/up rows f of assignment s's expert against its token, SiLU(gate) * up. Waits first:
        the expert ids come from the kernel just before. ROUTED: `ids_ptr` holds the router logits [T, E] instead,
        and the program ranks them itself (`_ranked_experts`: assignment s is token s // K's rank s % K).
        COMPOSED (with ROUTED; BLOCK_D >= D): x is the residual row, not yet normed, and the logits are a composed
        router's raw ones: the program applies the RMSNorm (weight nw_ptr, read before the wait) to the whole row
        itself, and ranks the raw logits (a positive scale keeps their order; the weights are down's)."""
        if COMPOSED:
            dn = tl.arange(0, BLOCK_D)
            nw = tl.load(nw_ptr + dn, mask=dn < D, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        s = tl.program_id(0)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        f_ok = f < F
        x_row = x_ptr + (s // K).to(tl.int64) * D
        if ROUTED:  # (COMPOSED: raw logits rank as the scaled ones do)
            ids, _, _ = _ranked_experts(ids_ptr, s // K, tl.zeros([1], tl.int32) + s % K, E, E_PAD)
            e = tl.max(ids, 0).to(tl.int64)
        else:
            e = tl.load(ids_ptr + s).to(tl.int64)
        acc_g = tl.zeros([BLOCK_F], tl.float32)
        acc_u = tl.zeros([BLOCK_F], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            ok = f_ok[:, None] & (d[None, :] < D)
            if COMPOSED:  # one pass (BLOCK_D >= D). (The norm placed after the weight loads holds both tiles in
                # registers, 167 against 96: 35.1% of the roofline against 38.9%, H200 B=1, session 22)
                x = _rmsnorm_row(tl.load(x_row + dn, mask=dn < D, other=0.0), nw, eps, D, h_ptr.dtype.element_ty)
                x = x.to(tl.float32)
            else:
                x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            wg = tl.load(w_ptr + e * s_we + f[:, None] * s_wf + d[None, :], mask=ok, other=0.0).to(tl.float32)
            wu = tl.load(w_ptr + e * s_we + (f + F)[:, None] * s_wf + d[None, :], mask=ok, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * x[None, :], 1)
            acc_u += tl.sum(wu * x[None, :], 1)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        tl.store(h_ptr + s.to(tl.int64) * F + f, (_silu(g, dt, False, LIBDEVICE) * u).to(dt), mask=f_ok)

    @triton.jit
    def _expert_gemm(a_ptr, rows_ptr, w_ptr, offsets_ptr, out_ptr, s_we, s_wn, N_OUT: tl.constexpr,
                     K_IN: tl.constexpr, GATED: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, STATIC_M: tl.constexpr, M_SPLITS: tl.constexpr,
                     LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        """Program (e, n, j): sorted rows [offsets[e-1], offsets[e]) times tile n of expert e's weights [N, K_IN],
        row chunks j, j + M_SPLITS, ... of BLOCK_M (an expert that many tokens chose is spread over M_SPLITS
        programs instead of looping alone while the rest of the GPU idles; a split with no rows exits).
        Row r reads input row rows[r] of `a` (the token; row r itself without GATHER) and writes output row r. GATED: the weights hold
        [gate; up] (2 * N_OUT rows) and the output is SiLU(gate) * up, rounded like the module path.
        STATIC_M > 0: a fixed trip count of that many rows, masked (the interpreter cannot loop to a loaded bound)."""
        pdl_wait(PDL)
        e = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N_OUT
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offsets_ptr + e)
        w_rows = w_ptr + e.to(tl.int64) * s_we + n[:, None] * s_wn
        dt = out_ptr.dtype.element_ty
        j = tl.program_id(2)
        # the interpreter cannot start a loop at a program id: it visits every chunk and masks the other splits'
        # (bounds inline: the interpreter turns assigned ints into tensors, which range() rejects)
        for i in range(0 if STATIC_M > 0 else j * BLOCK_M, STATIC_M if STATIC_M > 0 else end - start,
                       BLOCK_M if STATIC_M > 0 else M_SPLITS * BLOCK_M):
            m = start + i + tl.arange(0, BLOCK_M)
            # (a vector compare for the split: triton 3.9's interpreter rejects a mask mixed with a scalar one)
            m_ok = (m < end) & (m * 0 + (i // BLOCK_M) % M_SPLITS == j) if STATIC_M > 0 else m < end
            src = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64) if GATHER else m.to(tl.int64)
            a_rows = a_ptr + src[:, None] * K_IN
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K_IN, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K_IN
                a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
                if GATED:
                    w_up = tl.load(w_rows + N_OUT * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=PRECISION)
            if GATED:
                g = acc.to(dt).to(tl.float32)
                acc = _silu(g, dt, False, LIBDEVICE) * acc_up.to(dt).to(tl.float32)
            tl.store(out_ptr + m.to(tl.int64)[:, None] * N_OUT + n[None, :], acc.to(dt), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _align_by_expert(ids_ptr, token_ptr, dest_ptr, offsets_ptr, S, K: tl.constexpr, S_PAD: tl.constexpr,
                         PDL: tl.constexpr):
        """Program e: the rows of expert e's assignments in expert-sorted order (stable), and the end offset of e."""
        pdl_wait(PDL)
        e = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        ids = tl.load(ids_ptr + s, mask=s < S, other=-1)
        mine = (ids == e).to(tl.int32)
        start = tl.sum((ids < e).to(tl.int32) * (s < S).to(tl.int32), 0)
        dest = start + tl.cumsum(mine, 0) - 1
        ok = (mine == 1) & (s < S)
        tl.store(dest_ptr + s, dest.to(tl.int64), mask=ok)  # assignment s -> its row in sorted order
        tl.store(token_ptr + dest, (s // K).to(tl.int64), mask=ok)  # sorted row -> the token it reads
        tl.store(offsets_ptr + e, start + tl.sum(mine, 0))

    @triton.jit
    def _down_combine(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, s_we, s_wd, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                      K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, EARLY: tl.constexpr,
                      PDL: tl.constexpr, ROUTED: tl.constexpr = False, E: tl.constexpr = 1, E_PAD: tl.constexpr = 1,
                      SCALE: tl.constexpr = 1.0, NORM: tl.constexpr = False, COMPOSED: tl.constexpr = False,
                      x_ptr=None, eps=0.0, BLOCK_X: tl.constexpr = 1):
        """Program (t, j): outputs d of block j of token t, sum_k wts[t, k] * (h[t*K + k] . W_down[ids[t, k]][d]),
        each expert's product rounded first. The K experts' rows are one [K_PAD * BLOCK_D, BLOCK_F] tile, whose first
        F-block is read before the PDL wait: the ids are two kernels old (the router's; `_gate_up_silu` between
        triggers late), h is the last kernel's. ROUTED: `ids_ptr` holds the router logits [T, E], two kernels old
        too, and the program takes the ids and weights from them (`_ranked_experts`, `_routed_weights` with SCALE
        and NORM); `wts_ptr` is not read (None). COMPOSED (with ROUTED): the logits are a composed router's raw
        ones, scaled by 1 / RMS of the residual row x (read before the wait too: it was written before them)."""
        pdl_launch_next(PDL, EARLY)
        t = tl.program_id(0)
        r = tl.arange(0, K_PAD * BLOCK_D)
        k = r // BLOCK_D
        d = tl.program_id(1) * BLOCK_D + r % BLOCK_D
        ok = (k < K) & (d < D)
        s = (t * K + k).to(tl.int64)
        if COMPOSED:
            dx = tl.arange(0, BLOCK_X)
            xr = tl.load(x_ptr + t.to(tl.int64) * D + dx, mask=dx < D, other=0.0)
            ids, z, rank = _ranked_experts(ids_ptr, t, k, E, E_PAD, True, _rms_scale(xr, eps, D), xr.dtype)
            e = ids.to(tl.int64)
            wts = _routed_weights(z, rank, ids, SCALE, K, NORM)
        elif ROUTED:
            ids, z, rank = _ranked_experts(ids_ptr, t, k, E, E_PAD)
            e = ids.to(tl.int64)
            wts = _routed_weights(z, rank, ids, SCALE, K, NORM)
        else:
            e = tl.load(ids_ptr + s, mask=ok, other=0).to(tl.int64)
        w_rows = w_ptr + e[:, None] * s_we + d[:, None] * s_wd
        f = tl.arange(0, BLOCK_F)
        w = tl.load(w_rows + f[None, :], mask=ok[:, None] & (f[None, :] < F), other=0.0)
        pdl_wait(PDL, EARLY)  # (nothing may write the ids between the router's kernel and this one: they are read above)
        h_rows = h_ptr + s[:, None] * F
        h = tl.load(h_rows + f[None, :], mask=ok[:, None] & (f[None, :] < F), other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * h, 1)
        for f0 in range(BLOCK_F, F, BLOCK_F):
            ff = f0 + tl.arange(0, BLOCK_F)
            fm = ok[:, None] & (ff[None, :] < F)
            ww = tl.load(w_rows + ff[None, :], mask=fm, other=0.0).to(tl.float32)
            acc += tl.sum(ww * tl.load(h_rows + ff[None, :], mask=fm, other=0.0).to(tl.float32), 1)
        dt = y_ptr.dtype.element_ty
        if not ROUTED:
            wts = tl.load(wts_ptr + s, mask=ok, other=0.0)
        part = tl.reshape(acc.to(dt).to(tl.float32) * wts, [K_PAD, BLOCK_D])
        # the K products added in expert order, as the module path and the trainer's combine add them (a tree sum
        # could round differently): each term is a one-row sum, exact
        k_rows = tl.arange(0, K_PAD)[:, None]
        out = tl.zeros([BLOCK_D], tl.float32)
        for kk in tl.static_range(K):
            out += tl.sum(tl.where(k_rows == kk, part, 0.0), 0)
        d_out = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        tl.store(y_ptr + t.to(tl.int64) * D + d_out, out.to(dt), mask=d_out < D)


def fused_experts(experts: Experts, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Routed-expert output [T, D] of a decode batch (see the module docstring for the path taken)."""
    T, K = ids_TK.shape
    if (not x_TD.is_cuda and not triton_interpreting()) or T * K > ALIGN_MAX_ASSIGNMENTS:
        return experts.sorted_forward(x_TD, ids_TK, weights_TK, expert_counts(ids_TK, experts.num_experts))
    if uses_grouped_rows(x_TD, ids_TK):
        return grouped_experts(experts, x_TD, ids_TK, weights_TK)
    # (any cast before the first launch: down follows gate_up directly)
    return _few_token_experts(experts, x_TD.contiguous(), ids_TK.reshape(-1).contiguous(),
                              weights_TK.float().contiguous(), K, {})


# a one-token decode ranks its router logits inside the two expert kernels (`routed_experts`), one launch fewer per
# layer; MOELOOP_ROUTE_FOLD=off runs the top-k kernel between the router and the experts instead
ROUTE_FOLD = os.environ.get("MOELOOP_ROUTE_FOLD", "on").lower() != "off"


def routed_experts_apply(x_TD: torch.Tensor, moe: MoE) -> bool:
    """`routed_experts` takes this batch: `ROUTE_FOLD` on, Triton (CUDA or the interpreter), few assignments, a
    softmax router."""
    router = moe.gate
    return (ROUTE_FOLD and triton is not None and (x_TD.is_cuda or triton_interpreting())
            and x_TD.shape[0] * router.top_k <= FUSED_MAX_ASSIGNMENTS and router.scoring_func == "softmax")


def routed_experts(moe: MoE, x_TD: torch.Tensor, logits_TE: torch.Tensor,
                   norm: nn.Module | None = None) -> torch.Tensor:
    """Routed-expert output [T, D] from the router logits [T, E] of x, with the softmax top-k routing
    (`fused_decode.route_softmax_topk`) done inside the two expert kernels: no ids or weights in memory.
    With `norm` (an RMSNorm; `composed_applies`): x is the residual row before that norm, and the logits are a
    composed router's raw fp32 ones (`decode_packs.ComposedRouter`): gate_up applies the norm, down the 1 / RMS."""
    router, E = moe.gate, logits_TE.shape[1]
    routing = dict(ROUTED=True, E=E, E_PAD=max(16, triton.next_power_of_2(E)))
    down = dict(SCALE=float(router.routed_scaling_factor), NORM=bool(router.norm_topk_prob))
    up = {}
    if norm is not None:
        up = dict(COMPOSED=True, nw_ptr=norm.weight, eps=norm.eps)
        down.update(COMPOSED=True, x_ptr=x_TD, eps=norm.eps, BLOCK_X=triton.next_power_of_2(x_TD.shape[1]))
    return _few_token_experts(moe.experts, x_TD.contiguous(), logits_TE.contiguous(), None, router.top_k, routing,
                              down, up)


def composed_applies(x_TD: torch.Tensor, moe: MoE) -> bool:
    """`routed_experts` can take a composed router's logits for x: it applies, and gate_up holds x's whole row."""
    return routed_experts_apply(x_TD, moe) and triton.next_power_of_2(x_TD.shape[1]) <= FEW_MAX_WIDTH


def _few_token_experts(experts: Experts, x_TD: torch.Tensor, route: torch.Tensor, wts_S: torch.Tensor | None, K: int,
                       routing: dict, down_routing: dict | None = None, up_routing: dict | None = None) -> torch.Tensor:
    """`_gate_up_silu` then `_down_combine` over T * K assignments; `route`: the expert ids [T * K] (weights wts_S),
    or with `routing` (ROUTED) the router logits [T, E] (no wts_S: the down kernel derives the weights)."""
    w_gu, w_d = experts.gate_up_proj, experts.down_proj
    D, F, T = experts.dim, experts.ffn_dim, x_TD.shape[0]
    h_SF = x_TD.new_empty(T * K, F)
    y_TD = torch.empty_like(x_TD)
    # narrow tiles, many programs, a whole weight row per program: at B=1 this is a weight stream of K experts,
    # bound by the bytes in flight
    pdl = pdl_args(x_TD, T)
    (block_f, warps_f), (block_d, warps_d) = GATE_UP_FEW_TILE, DOWN_FEW_TILE
    # down's tile: K_PAD * BLOCK_D rows x BLOCK_F columns, at most 4 * FEW_MAX_WIDTH values (512 columns at K=4)
    k_pad = triton.next_power_of_2(K)
    down_block_f = min(FEW_MAX_WIDTH * 4 // (k_pad * block_d), triton.next_power_of_2(F))
    _gate_up_silu[(T * K, triton.cdiv(F, block_f))](x_TD, w_gu, route, h_SF, w_gu.stride(0), w_gu.stride(1),
                                                     D=D, F=F, K=K, BLOCK_F=block_f,
                                                     BLOCK_D=min(FEW_MAX_WIDTH, triton.next_power_of_2(D)),
                                                     LIBDEVICE=not triton_interpreting(), num_warps=warps_f, **routing,
                                                     **(up_routing or {}), **pdl)
    _down_combine[(T, triton.cdiv(D, block_d))](h_SF, w_d, route, wts_S, y_TD, w_d.stride(0), w_d.stride(1), D=D, F=F,
                                                 K=K, K_PAD=k_pad, BLOCK_D=block_d, BLOCK_F=down_block_f,
                                                 EARLY=kernel_switch.PDL_EARLY, num_warps=warps_d, **routing,
                                                 **(down_routing or {}), **pdl)
    return y_TD


def grouped_experts(experts: Experts, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                    gemm: str | None = None) -> torch.Tensor:
    """`Experts.sorted_forward` as counting sort, 2 grouped GEMMs (the first fused with the gather and SiLU*up),
    weighted sum; `gemm` = "triton" | "grouped_mm" (default `GROUPED_GEMM`; grouped_mm adds a gather and the
    activation's kernels). Same assignment order and rounding points, so the same numbers up to GEMM
    accumulation order."""
    y_SD, dest_S = grouped_expert_rows(experts, x_TD, ids_TK, gemm)
    return combine(y_SD, dest_S.view(ids_TK.shape), weights_TK.float().contiguous(), x_TD.shape[0])


def grouped_expert_rows(experts: Experts, x_TD: torch.Tensor, ids_TK: torch.Tensor,
                        gemm: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_SD: each assignment's expert output in expert-sorted order, dest_S: assignment t*K+k -> its row), for
    a weighted sum done by the caller (`grouped_experts`, or the fused decode's combine + add + RMSNorm)."""
    T, K = ids_TK.shape
    S, E = T * K, experts.num_experts
    ids_S = ids_TK.reshape(-1).contiguous()
    dest_S = torch.empty(S, dtype=torch.int64, device=x_TD.device)
    token_S = torch.empty(S, dtype=torch.int64, device=x_TD.device)
    offsets_E = torch.empty(E, dtype=torch.int32, device=x_TD.device)
    _align_by_expert[(E,)](ids_S, token_S, dest_S, offsets_E, S, K=K, S_PAD=triton.next_power_of_2(S), num_warps=4,
                           **pdl_args(x_TD, T))
    if (gemm or GROUPED_GEMM) == "grouped_mm":
        return experts._grouped(x_TD.index_select(0, token_S), offsets_E), dest_S
    return _triton_grouped(experts, x_TD.contiguous(), token_S, offsets_E, S), dest_S


def uses_grouped_rows(x_TD: torch.Tensor, ids_TK: torch.Tensor) -> bool:
    """Whether `fused_experts` takes the grouped path for this batch (so a caller may combine the rows itself)."""
    S = ids_TK.numel()
    return FUSED_MAX_ASSIGNMENTS < S <= ALIGN_MAX_ASSIGNMENTS and (GROUPED_GEMM == "triton" or x_TD.dtype == torch.bfloat16)


def _triton_grouped(experts: Experts, x_TD: torch.Tensor, token_S: torch.Tensor, offsets_E: torch.Tensor,
                    S: int) -> torch.Tensor:
    """y_SD = down(SiLU(gate) * up) of each sorted row, via two `_expert_gemm` launches."""
    E, D, F = experts.num_experts, experts.dim, experts.ffn_dim
    w_gu, w_d = experts.gate_up_proj, experts.down_proj
    # M tile: room for BLOCK_M_SLACK x the mean rows per expert, so most experts take one pass over their weight
    # tile (tl.dot wants >= 16 rows); N/K tiles: the weight tile each program streams
    block_m = min(64, max(16, triton.next_power_of_2(-(-BLOCK_M_SLACK * S // E))))
    precision = "ieee" if x_TD.dtype == torch.float32 else "tf32"
    static_m = S if triton_interpreting() else 0
    h_SF = x_TD.new_empty(S, F)
    y_SD = x_TD.new_empty(S, D)
    pdl = pdl_args(x_TD, x_TD.shape[0])
    for a, w, out, n_out, k_in, gated, (bn, bk, warps, stages) in (
            (x_TD, w_gu, h_SF, F, D, True, GATE_UP_TILE), (h_SF, w_d, y_SD, D, F, False, DOWN_TILE)):
        _expert_gemm[(E, triton.cdiv(n_out, bn), M_SPLITS)](a, token_S, w, offsets_E, out, w.stride(0), w.stride(1), N_OUT=n_out,
                                                  K_IN=k_in, GATED=gated, GATHER=gated, BLOCK_M=block_m, BLOCK_N=bn,
                                                  BLOCK_K=bk, PRECISION=precision, STATIC_M=static_m, M_SPLITS=M_SPLITS,
                                                  LIBDEVICE=not triton_interpreting(), num_warps=warps,
                                                  num_stages=stages, **pdl)
    return y_SD


if triton is not None:
    register_experts_impl(IMPL_NAME, fused_experts)


@contextmanager
def decode_moe(model: nn.Module, blocks: list[MoE] | None = None, kernels: bool = True) -> Iterator[None]:
    """Inside: every MoE block skips router stats (same outputs, fewer ops) and, with `kernels` and triton, runs
    `fused_experts`; restored on exit (a shared model trains). `blocks`: the model's MoE blocks, when the caller
    has them (saves a module walk per step)."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)] if blocks is None else blocks
    saved = [(b.record_stats, b.experts.impl) for b in blocks]
    # plain attributes written straight into __dict__: nn.Module.__setattr__ costs ~5 us a call, 64 per decode step
    # (the impl name is one `register_experts_impl` made valid, so the property's check is not needed)
    try:
        for b in blocks:
            b.__dict__["record_stats"] = False
            if kernels and triton is not None:
                b.experts.__dict__["_impl"] = IMPL_NAME
        yield
    finally:
        for b, (record, impl) in zip(blocks, saved):
            b.__dict__["record_stats"], b.experts.__dict__["_impl"] = record, impl
