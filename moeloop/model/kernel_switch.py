"""Whether moeloop's own Triton kernels run: triton must be importable (the CPU wheel of torch ships without it),
the tensors on CUDA, and the switch on. `MOELOOP_KERNELS=off` runs torch ops everywhere instead (training
norms, expert row moves, logprob chunks; the rollout's fused decode, paged attention, MoE and sampling kernels),
with the same math: for bisecting a numerical difference, or a GPU / Triton build that a kernel does not support.
Every kernel module takes `triton` from here, and the bf16 rounding helpers that also hold under the interpreter."""
from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:
    triton = None


def kernels_enabled() -> bool:
    return os.environ.get("MOELOOP_KERNELS", "on").lower() != "off"


def kernels_apply(x: torch.Tensor) -> bool:
    """The Triton path for tensors like x: triton installed, x on CUDA, the switch on."""
    return triton is not None and x.is_cuda and kernels_enabled()


def triton_interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def rounds_by_bits(dtype: torch.dtype) -> bool:
    """Kernels round to bf16 with `bf16_rne` instead of a cast: under the interpreter, whose cast truncates."""
    return triton_interpreting() and dtype == torch.bfloat16


if triton is not None:
    import triton.language as tl

    @triton.jit
    def bf16_rne(x):
        """fp32 -> nearest-even bf16 value, kept in fp32, by bits: the interpreter's cast truncates instead."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def rounded(x, dt: tl.constexpr, BY_BITS: tl.constexpr):
        """fp32 x rounded to dt, kept in fp32 (BY_BITS: `rounds_by_bits` said so)."""
        if BY_BITS:
            return bf16_rne(x)
        return x.to(dt).to(tl.float32)
