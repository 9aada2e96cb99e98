"""SiLU(gate) * up of the experts' gate_up output h = cat[gate, up] as one Triton kernel forward and one backward
(CUDA; in torch ops that is silu and a mul over strided halves, and silu_backward and two muls back).

Same math and rounding points as torch's CUDA kernels: silu(x) = x / (1 + expf(-x)) in fp32 (libdevice expf, IEEE
division), rounded to the dtype, times up, rounded; the backward is autograd's: grad_up = g * s and grad_s = g * up,
each rounded, then silu_backward grad_s * sig * (1 + x * (1 - sig)), sig = 1 / (1 + expf(-x)). Only h is saved
(the torch path keeps h and silu(gate)).
"""
# S rows (sorted assignments), F expert ffn dim
from __future__ import annotations

import torch

from moeloop.model.kernel_switch import kernels_apply, rounds_by_bits, triton, triton_interpreting

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from moeloop.model.kernel_switch import bf16_rne, rounded  # bf16 rounding that also holds under the interpreter

    @triton.jit
    def _one_plus_exp_neg(x, LIBDEVICE: tl.constexpr):
        """1 + expf(-x) in fp32: libdevice's expf, the one torch's CUDA silu calls (numpy's exp under the
        interpreter, which has no libdevice)."""
        if LIBDEVICE:
            return 1.0 + libdevice.exp(-x)
        return 1.0 + tl.exp(-x)

    @triton.jit
    def _silu(x, dt: tl.constexpr, BY_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
        """silu(x) of fp32 x as torch's CUDA kernel computes it (x / (1 + expf(-x)), IEEE division), rounded to
        dt, in fp32 (also the rollout's decode MoE kernels)."""
        return rounded(tl.math.div_rn(x, _one_plus_exp_neg(x, LIBDEVICE)), dt, BY_BITS)

    @triton.jit
    def _gate_up_tile(h_ptr, num_rows, s_h, F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        """This program's tile: (rows, cols f, mask, gate = h[rows, f], up = h[rows, F + f]) in fp32."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = (rows < num_rows)[:, None] & (f < F)[None, :]
        gate_ptr = h_ptr + (rows * s_h)[:, None] + f[None, :]
        x = tl.load(gate_ptr, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + F, mask=ok, other=0.0).to(tl.float32)
        return rows, f, ok, x, up

    @triton.jit
    def _swiglu_fwd(h_ptr, y_ptr, num_rows, s_h, F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BY_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
        """y [S, F] (contiguous) = silu(gate) * up, gate = h[:, :F] and up = h[:, F:] of h [S, 2F] (row stride s_h)."""
        rows, f, ok, x, up = _gate_up_tile(h_ptr, num_rows, s_h, F, BLOCK_F, BLOCK_ROWS)
        dt = y_ptr.dtype.element_ty
        y = _silu(x, dt, BY_BITS, LIBDEVICE) * up
        if BY_BITS:
            y = bf16_rne(y)
        tl.store(y_ptr + (rows * F)[:, None] + f[None, :], y.to(dt), mask=ok)

    @triton.jit
    def _swiglu_bwd(h_ptr, dy_ptr, dh_ptr, num_rows, s_h, s_dy, F: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BY_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
        """dh [S, 2F] (contiguous; the gate's gradient in [:, :F], up's in [:, F:]) from dy [S, F] (row stride s_dy)
        and h [S, 2F] (row stride s_h)."""
        rows, f, ok, x, up = _gate_up_tile(h_ptr, num_rows, s_h, F, BLOCK_F, BLOCK_ROWS)
        dt = dh_ptr.dtype.element_ty
        dy = tl.load(dy_ptr + (rows * s_dy)[:, None] + f[None, :], mask=ok, other=0.0).to(tl.float32)
        denom = _one_plus_exp_neg(x, LIBDEVICE)
        s = rounded(tl.math.div_rn(x, denom), dt, BY_BITS)  # the forward's silu(gate), which autograd saves
        sig = tl.math.div_rn(1.0, denom)
        d_up = dy * s
        d_s = rounded(dy * up, dt, BY_BITS)
        d_x = d_s * sig * (1.0 + x * (1.0 - sig))
        if BY_BITS:
            d_x, d_up = bf16_rne(d_x), bf16_rne(d_up)
        dx_ptr = dh_ptr + (rows * 2 * F)[:, None] + f[None, :]
        tl.store(dx_ptr, d_x.to(dt), mask=ok)
        tl.store(dx_ptr + F, d_up.to(dt), mask=ok)


def _launch(h_S2F: torch.Tensor, dy_SF: torch.Tensor | None) -> torch.Tensor:
    """The forward's y [S, F], or with dy the backward's dh [S, 2F]; both contiguous."""
    S, F = h_S2F.shape[0], h_S2F.shape[1] // 2
    block_f = min(triton.next_power_of_2(F), 256)
    block_rows = max(1, 2048 // block_f)  # 2048 elements a program: 8 a thread at 8 warps, one 16-byte bf16 load
    out = torch.empty((S, F) if dy_SF is None else (S, 2 * F), dtype=h_S2F.dtype, device=h_S2F.device)
    if S * F == 0:
        return out
    grid = (triton.cdiv(S, block_rows), triton.cdiv(F, block_f))
    # fp fusion on (unlike rope_kernel), as nvcc's default --fmad=true in torch's build: the only product-add pairs
    # here are the ones nvcc contracts in torch's silu kernels (expf's final scaling into 1 + expf(-x); the
    # backward's x * (1 - sig) into 1 + ...); no product that torch rounds to the dtype feeds an add. libdevice
    # without flush-to-zero, also nvcc's default.
    meta = dict(F=F, BLOCK_F=block_f, BLOCK_ROWS=block_rows, LIBDEVICE=not triton_interpreting(),
                BY_BITS=rounds_by_bits(h_S2F.dtype), num_warps=8,
                enable_fp_fusion=True, enable_reflect_ftz=False)
    if dy_SF is None:
        _swiglu_fwd[grid](h_S2F, out, S, h_S2F.stride(0), **meta)
    else:
        if dy_SF.stride(-1) != 1:
            dy_SF = dy_SF.contiguous()
        _swiglu_bwd[grid](h_S2F, dy_SF, out, S, h_S2F.stride(0), dy_SF.stride(0), **meta)
    return out


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_S2F):
        ctx.save_for_backward(h_S2F)
        return _launch(h_S2F, None)

    @staticmethod
    def backward(ctx, dy_SF):
        (h_S2F,) = ctx.saved_tensors
        return _launch(h_S2F, dy_SF)


def swiglu_kernel_applies(h_S2F: torch.Tensor) -> bool:
    """The Triton path: CUDA, triton installed, h [S, 2F] in fp32/bf16/fp16 with a last-dim stride of 1."""
    return (kernels_apply(h_S2F) and h_S2F.dim() == 2 and h_S2F.shape[1] % 2 == 0 and h_S2F.stride(1) == 1
            and h_S2F.dtype in (torch.float32, torch.bfloat16, torch.float16))


def swiglu_kernel(h_S2F: torch.Tensor) -> torch.Tensor:
    """SiLU(h[:, :F]) * h[:, F:] on the Triton path, on any tensors the kernel can read (tests run it on CPU under
    the interpreter)."""
    return _SwigluFn.apply(h_S2F)
