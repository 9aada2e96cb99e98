"""Half-split rotary embedding as one Triton kernel forward and one backward (CUDA; the rotation in torch ops is
chunk, neg, cat, two muls and an add, and as many again in its backward).

Same rounding points as the torch ops in the input dtype: each product rounded, then the sum rounded; the backward
is autograd's g * cos + cat((g * sin)_2, -(g * sin)_1), both terms rounded before the one add (a two-term sum, so
autograd's accumulation order cannot matter). Values and input gradients are bit-identical to the torch path.
"""
# T tokens, H heads, R rotary dim (even), R2 = R // 2
from __future__ import annotations

import torch

from moeloop.model.kernel_switch import kernels_apply, rounds_by_bits, triton

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import bf16_rne, rounded

    @triton.jit
    def _rope_half_split(x_ptr, cos_ptr, sin_ptr, y_ptr, num_rows, s_xt, s_xh, H: tl.constexpr, R2: tl.constexpr,
                         BLOCK_R2: tl.constexpr, BLOCK_ROWS: tl.constexpr, BACKWARD: tl.constexpr,
                         BY_BITS: tl.constexpr):
        """Rows (t, h) = divmod(row, H) of x [T, H, R] (strides s_xt, s_xh, 1) into contiguous y: the rotation, or
        with BACKWARD its transpose applied to the output gradient x. cos/sin: contiguous [T, R]."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        i = tl.arange(0, BLOCK_R2)
        ok = (rows < num_rows)[:, None] & (i < R2)[None, :]
        t, h = rows // H, rows % H
        x1_ptr = x_ptr + (t * s_xt + h * s_xh)[:, None] + i[None, :]
        tab = (t * 2 * R2)[:, None] + i[None, :]
        dt = y_ptr.dtype.element_ty
        x1 = tl.load(x1_ptr, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x1_ptr + R2, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + tab, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tab + R2, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tab, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tab + R2, mask=ok, other=0.0).to(tl.float32)
        if BACKWARD:  # g * cos + cat((g * sin)_2, -(g * sin)_1)
            y1 = rounded(x1 * c1, dt, BY_BITS) + rounded(x2 * s2, dt, BY_BITS)
            y2 = rounded(x2 * c2, dt, BY_BITS) - rounded(x1 * s1, dt, BY_BITS)
        else:  # x * cos + cat(-x2, x1) * sin
            y1 = rounded(x1 * c1, dt, BY_BITS) - rounded(x2 * s1, dt, BY_BITS)
            y2 = rounded(x2 * c2, dt, BY_BITS) + rounded(x1 * s2, dt, BY_BITS)
        if BY_BITS:
            y1, y2 = bf16_rne(y1), bf16_rne(y2)
        y1_ptr = y_ptr + (rows * 2 * R2)[:, None] + i[None, :]
        tl.store(y1_ptr, y1.to(dt), mask=ok)
        tl.store(y1_ptr + R2, y2.to(dt), mask=ok)


def _launch(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, backward: bool) -> torch.Tensor:
    """y [T, H, R], contiguous, from x with any row and head strides (a last-dim stride other than 1 is copied)."""
    if x_THR.stride(-1) != 1:
        x_THR = x_THR.contiguous()
    T, H, R = x_THR.shape
    y_THR = torch.empty((T, H, R), dtype=x_THR.dtype, device=x_THR.device)
    block_r2 = triton.next_power_of_2(R // 2)
    block_rows = max(1, 2048 // block_r2)  # 4096 elements a program for R=128
    by_bits = rounds_by_bits(x_THR.dtype)
    if T * H:
        # no fp fusion: LLVM turns each bf16 round trip into a bf16 mul and add, which fusion would merge into an
        # FMA that skips the product's rounding (in fp32 likewise)
        _rope_half_split[(triton.cdiv(T * H, block_rows),)](
            x_THR, cos_TR, sin_TR, y_THR, T * H, x_THR.stride(0), x_THR.stride(1), H=H, R2=R // 2, BLOCK_R2=block_r2,
            BLOCK_ROWS=block_rows, BACKWARD=backward, BY_BITS=by_bits, num_warps=4, enable_fp_fusion=False)
    return y_THR


class _RopeHalfSplitFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_THR, cos_TR, sin_TR):
        cos_TR, sin_TR = cos_TR.contiguous(), sin_TR.contiguous()
        ctx.save_for_backward(cos_TR, sin_TR)
        return _launch(x_THR, cos_TR, sin_TR, backward=False)

    @staticmethod
    def backward(ctx, grad_THR):
        cos_TR, sin_TR = ctx.saved_tensors
        return _launch(grad_THR, cos_TR, sin_TR, backward=True), None, None


def rope_kernel_applies(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> bool:
    """The Triton path: CUDA, triton installed, x [T, H, R] and cos/sin [T, R] of one dtype, no gradient for the
    tables (the kernel gives none)."""
    return (kernels_apply(x_THR) and x_THR.dim() == 3 and x_THR.dtype == cos_TR.dtype == sin_TR.dtype
            and cos_TR.shape == sin_TR.shape == (x_THR.shape[0], x_THR.shape[2]) and x_THR.shape[2] % 2 == 0
            and not (cos_TR.requires_grad or sin_TR.requires_grad))


def rope_half_split_kernel(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """The Triton path on any tensors the kernel can read (tests run it on CPU under the interpreter)."""
    return _RopeHalfSplitFn.apply(x_THR, cos_TR, sin_TR)
