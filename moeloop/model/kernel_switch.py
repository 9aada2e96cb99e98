"""Whether moeloop's own Triton kernels run: triton must be importable (the CPU wheel of torch ships without it),
the tensors on CUDA, and the switch on. `MOELOOP_KERNELS=off` runs torch ops everywhere instead (training
norms, expert row moves, logprob chunks; the rollout's fused decode, paged attention, MoE and sampling kernels),
with the same math: for bisecting a numerical difference, or a GPU / Triton build that a kernel does not support.
Every kernel module takes `triton` from here."""
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
