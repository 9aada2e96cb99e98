"""RMSNorm, computed in fp32 and cast back, exactly as transformers' Llama/Qwen/DeepSeek RMSNorm.

On CUDA (weight and input of one dtype, triton installed) the forward and backward are single Triton kernels
instead of ~6 and ~10 elementwise passes, and autograd keeps only the input and one fp32 scale per row. Same
rounding points as the module math: normalised value rounded to the input dtype, then times the weight and
rounded; the backward takes d(normalised) = grad * weight rounded to the dtype, as autograd does, and sums the
weight gradient in fp32. Reductions differ in order only.
"""
# R rows, D normalised dim
from __future__ import annotations

import torch
from torch import nn

from moeloop.model.kernel_switch import kernels_apply, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, eps, R, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_R: tl.constexpr):
        """Rows [p * BLOCK_R, (p + 1) * BLOCK_R): several short rows a program (a q/k head norm is 128 wide)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        m = (rows < R)[:, None] & (d < D)[None, :]
        dt = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
        normed = (x * rstd[:, None]).to(dt).to(tl.float32)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * D + d[None, :], (w[None, :] * normed).to(dt), mask=m)
        tl.store(rstd_ptr + rows, rstd, mask=rows < R)

    @triton.jit
    def _rmsnorm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
        """Program p: rows [p * ROWS, (p + 1) * ROWS), BLOCK_R at a time; its partial weight gradient goes to
        dw[p]."""
        p = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        dt = dx_ptr.dtype.element_ty
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], tl.float32)
        for i in range(0, ROWS, BLOCK_R):
            rows = p * ROWS + i + tl.arange(0, BLOCK_R)
            m = (rows < R)[:, None] & d_ok[None, :]
            x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + tl.minimum(rows, R - 1))  # a dead row (past R) reads a live one, stores nothing
            dw += tl.sum(dy * (x * rstd[:, None]).to(dt).to(tl.float32), 0)
            dn = (dy * w[None, :]).to(dt).to(tl.float32)  # autograd's grad of the normalised value, in the input dtype
            dx = rstd[:, None] * dn - x * (rstd * rstd * rstd)[:, None] * (tl.sum(dn * x, 1) / D)[:, None]
            tl.store(dx_ptr + rows[:, None] * D + d[None, :], dx.to(dt), mask=m)
        tl.store(dw_ptr + p * D + d, dw, mask=d_ok)


def _row_block(D: int) -> tuple[int, int]:
    """(BLOCK_D, rows a tile): ~2048 elements a tile, so a 128-wide head norm is not one tiny program a row."""
    block_d = triton.next_power_of_2(D)
    return block_d, max(1, 2048 // block_d)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        D = x.shape[-1]
        x_RD = x.reshape(-1, D).contiguous()
        R = x_RD.shape[0]
        y_RD = torch.empty_like(x_RD)
        rstd_R = torch.empty(R, dtype=torch.float32, device=x.device)
        if R:
            block_d, block_r = _row_block(D)
            _rmsnorm_fwd[(triton.cdiv(R, block_r),)](x_RD, weight, y_RD, rstd_R, eps, R, D=D, BLOCK_D=block_d,
                                                     BLOCK_R=block_r, num_warps=4 if D <= 2048 else 8)
        ctx.save_for_backward(x_RD, weight, rstd_R)
        return y_RD.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_RD, weight, rstd_R = ctx.saved_tensors
        R, D = x_RD.shape
        rows = 32  # rows per program: fewer partial weight-gradient rows to sum
        programs = triton.cdiv(R, rows)
        dx_RD = torch.empty_like(x_RD)
        dw_PD = torch.empty(max(programs, 1), D, dtype=torch.float32, device=x_RD.device)
        if R:
            block_d, block_r = _row_block(D)
            _rmsnorm_bwd[(programs,)](dy.reshape(-1, D).contiguous(), x_RD, weight, rstd_R, dx_RD, dw_PD, R, D=D,
                                      BLOCK_D=block_d, ROWS=rows, BLOCK_R=min(block_r, rows),
                                      num_warps=4 if D <= 2048 else 8)
        else:
            dw_PD.zero_()
        return dx_RD.view(dy.shape), dw_PD.sum(0).to(weight.dtype), None


def fused_rmsnorm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton path: CUDA, triton installed, input and weight of one dtype."""
    return kernels_apply(x) and x.dtype == weight.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rmsnorm_applies(x, self.weight):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rmsnorm_reference(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The module math in torch ops (any device): fp32 normalisation, rounded to x's dtype, times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rmsnorm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton path on any tensors the kernels can read (tests run it on CPU under the interpreter)."""
    return _RMSNormFn.apply(x, weight, eps)
