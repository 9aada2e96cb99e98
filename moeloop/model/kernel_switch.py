"""One switch for moeloop's own Triton kernels on CUDA (training norms, expert row moves, logprob chunks; the
rollout's fused decode, paged attention, MoE and sampling kernels): `MOELOOP_KERNELS=off` runs torch ops
everywhere instead, with the same math. For bisecting a numerical difference, or a GPU / Triton build that a
kernel does not support."""
from __future__ import annotations

import os


def kernels_enabled() -> bool:
    return os.environ.get("MOELOOP_KERNELS", "on").lower() != "off"
