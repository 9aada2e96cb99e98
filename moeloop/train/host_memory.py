"""Host allocator policy for training on CPU: keep freed blocks for reuse, as the CUDA caching allocator does.

glibc serves every allocation above its mmap threshold (at most 32 MiB under its dynamic rule) with a fresh
mmap and unmaps it on free, so each optimizer step's large gradients and activations are page-faulted and
zeroed by the kernel again (~90k faults, about 12% of the update at the large CPU benchmark size; none
once warm after this). Raising the mmap and trim thresholds serves them from the heap and keeps them there;
the cost is resident memory that stays at its peak plus heap slack (2.7 vs 2.3 GB RSS at that size).
Process-wide, so it is called by the RL entry point for a CPU run, never on import.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
_MAX_INT = 2**31 - 1


@functools.cache
def retain_freed_host_memory() -> bool:
    """Set glibc's trim threshold to the maximum and its mmap threshold to 1 GiB, once per process; False
    (and nothing changed) where the C library has no `mallopt` (macOS, musl) or refuses the values."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _MAX_INT)) and bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30))
