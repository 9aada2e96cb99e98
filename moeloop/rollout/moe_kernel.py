"""Fused Triton MoE for decode: the engine's `Experts` implementation "rollout_decode" on CUDA.

Few tokens (T*K <= `FUSED_MAX_ASSIGNMENTS`, or any count outside bf16, where grouped_mm would sync the host)
run two kernels with no sort: gate_up + SiLU*up per assignment, then down + the weighted sum over the K
experts of each token. More tokens take the built-in sorted grouped_mm path (each expert's weights read once).
Both are free of host syncs, so they can be captured in a CUDA graph. Rounding points follow `Experts`.
"""
# T tokens, D model dim, F expert ffn dim, K experts per token, S = T*K assignments
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import nn

from moeloop.model.experts import Experts, expert_counts, register_experts_impl
from moeloop.model.moe import MoE
from moeloop.rollout.decode_kernel import triton

FUSED_MAX_ASSIGNMENTS = 32
IMPL_NAME = "rollout_decode"

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gate_up_silu(x_ptr, w_ptr, ids_ptr, h_ptr, s_we, s_wf, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        f_ok = f < F
        e = tl.load(ids_ptr + s).to(tl.int64)
        x_row = x_ptr + (s // K).to(tl.int64) * D
        acc_g = tl.zeros([BLOCK_F], tl.float32)
        acc_u = tl.zeros([BLOCK_F], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            ok = f_ok[:, None] & (d[None, :] < D)
            x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            wg = tl.load(w_ptr + e * s_we + f[:, None] * s_wf + d[None, :], mask=ok, other=0.0).to(tl.float32)
            wu = tl.load(w_ptr + e * s_we + (f + F)[:, None] * s_wf + d[None, :], mask=ok, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * x[None, :], 1)
            acc_u += tl.sum(wu * x[None, :], 1)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(h_ptr + s.to(tl.int64) * F + f, (act * u).to(dt), mask=f_ok)

    @triton.jit
    def _down_combine(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, s_we, s_wd, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
        t = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        dt = y_ptr.dtype.element_ty
        out = tl.zeros([BLOCK_D], tl.float32)
        for k in tl.static_range(K):
            s = t * K + k
            e = tl.load(ids_ptr + s).to(tl.int64)
            acc = tl.zeros([BLOCK_D], tl.float32)
            for f0 in range(0, F, BLOCK_F):
                f = f0 + tl.arange(0, BLOCK_F)
                h = tl.load(h_ptr + s.to(tl.int64) * F + f, mask=f < F, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + e * s_we + d[:, None] * s_wd + f[None, :], mask=d_ok[:, None] & (f[None, :] < F),
                            other=0.0).to(tl.float32)
                acc += tl.sum(w * h[None, :], 1)
            out += acc.to(dt).to(tl.float32) * tl.load(wts_ptr + s)
        tl.store(y_ptr + t.to(tl.int64) * D + d, out.to(dt), mask=d_ok)


def fused_experts(experts: Experts, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Routed-expert output [T, D] of a decode batch (see the module docstring for the path taken)."""
    T, K = ids_TK.shape
    w_gu, w_d = experts.gate_up_proj, experts.down_proj
    if (T * K > FUSED_MAX_ASSIGNMENTS and x_TD.dtype == torch.bfloat16) or (not x_TD.is_cuda and not _interpreting()):
        return experts.sorted_forward(x_TD, ids_TK, weights_TK, expert_counts(ids_TK, experts.num_experts))
    D, F = experts.dim, experts.ffn_dim
    x_TD, ids_S = x_TD.contiguous(), ids_TK.reshape(-1).contiguous()
    h_SF = x_TD.new_empty(T * K, F)
    _gate_up_silu[(T * K, triton.cdiv(F, 16))](x_TD, w_gu, ids_S, h_SF, w_gu.stride(0), w_gu.stride(1),
                                                D=D, F=F, K=K, BLOCK_F=16, BLOCK_D=128, num_warps=4)
    y_TD = torch.empty_like(x_TD)
    _down_combine[(T, triton.cdiv(D, 8))](h_SF, w_d, ids_S, weights_TK.float().contiguous(), y_TD,
                                           w_d.stride(0), w_d.stride(1), D=D, F=F, K=K, BLOCK_D=8, BLOCK_F=128, num_warps=4)
    return y_TD


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    register_experts_impl(IMPL_NAME, fused_experts)


@contextmanager
def decode_moe(model: nn.Module) -> Iterator[None]:
    """Inside: every MoE block skips router stats and runs `fused_experts`; restored on exit (a shared model trains)."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    saved = [(b.record_stats, b.experts.impl) for b in blocks]
    try:
        for b in blocks:
            b.record_stats = False
            if triton is not None:
                b.experts.impl = IMPL_NAME
        yield
    finally:
        for b, (record, impl) in zip(blocks, saved):
            b.record_stats, b.experts.impl = record, impl
