"""Whether moeloop's own Triton kernels run: triton must be importable (the CPU wheel of torch ships without it),
the tensors on CUDA, and the switch on. `MOELOOP_KERNELS=off` runs torch ops everywhere instead (training
norms, expert row moves, logprob chunks; the rollout's fused decode, paged attention, MoE and sampling kernels),
with the same math: for bisecting a numerical difference, or a GPU / Triton build that a kernel does not support.
Every kernel module takes `triton` from here, and the bf16 rounding helpers that also hold under the interpreter.

Programmatic dependent launch (PDL, `pdl_applies`): on Hopper and later, the rollout's decode kernels are launched
so that each may start while the kernel before it finishes. A kernel loads what no recent kernel writes (its
weights) first, then `pdl_wait`s for the kernel before it to complete, and only then reads that kernel's output or
stores anything. A kernel lets its successor launch after its own wait by default; so a kernel's early phase may
also read what the kernels two or more launches back wrote. A kernel may instead let its successor launch as soon
as it starts (`pdl_launch_next` with EARLY, `PDL_EARLY`): then a whole run of kernels can be resident at once, each
loading its weights, and a kernel's early phase may read a non-constant buffer only if some kernel launched after
that buffer's writer and before the reader triggers late (after its wait). The decode forward keeps that rule:
see `fused_decode.fused_decode_forward`. `MOELOOP_PDL=off` launches them one after another."""
from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a triton without grid dependency control (before 3.3): launch without PDL
    gdc_launch_dependents = gdc_wait = None


def env_tile(name: str, default: tuple[int, ...], powers_of_two: bool = True) -> tuple[int, ...]:
    """A kernel tile from environment variable `name` ("rows,warps"; one value for a scalar knob), else `default`:
    for A/Bs, and for the tiles `benchmarks/b1_tiles.py` finds on another GPU. The variable is MOELOOP_ and the
    module constant's name (`MOELOOP_ROW_LINEAR_TILE` for `ROW_LINEAR_TILE`). A malformed value, or with
    `powers_of_two` one that is not a power of two (block sizes and warps), raises a ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        tile = tuple(int(v) for v in raw.split(","))
    except ValueError:
        tile = ()
    if len(tile) != len(default) or min(tile) < 1:
        raise ValueError(f"{name}={raw!r}: expected {len(default)} positive comma-separated integers, like "
                         f"{','.join(map(str, default))}")
    if powers_of_two and any(v & (v - 1) for v in tile):
        raise ValueError(f"{name}={raw!r}: each value must be a power of two (block sizes and warps)")
    return tile


def kernels_enabled() -> bool:
    return os.environ.get("MOELOOP_KERNELS", "on").lower() != "off"


def kernels_apply(x: torch.Tensor) -> bool:
    """The Triton path for tensors like x: triton installed, x on CUDA, the switch on."""
    return triton is not None and x.is_cuda and kernels_enabled()


def triton_interpreting() -> bool:
    """Kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_PDL_DEVICES: dict[torch.device, bool] = {}
# PDL pays off where a step is many short kernels, not for large batches (H200, reference model, the decode forward's
# CUDA graph alone: B=1 0.629 -> 0.457 ms, B=128 2.11 -> 2.10 ms, B=256 2.45 -> 2.58 ms; `profile_decode.py`)
PDL_MAX_ROWS = int(os.environ.get("MOELOOP_PDL_MAX_ROWS", "8"))  # (the variable: for A/Bs)


def pdl_applies(x: torch.Tensor, rows: int) -> bool:
    """Launch a decode kernel over `rows` tokens of x's device with programmatic dependent launch: at most
    PDL_MAX_ROWS rows, compiled (not interpreted) on a CUDA device of compute capability 9 or more, with a triton
    that has grid dependency control, `MOELOOP_PDL` not off."""
    if rows > PDL_MAX_ROWS or not x.is_cuda or gdc_wait is None or triton_interpreting():
        return False
    if os.environ.get("MOELOOP_PDL", "on").lower() == "off":
        return False
    if x.device not in _PDL_DEVICES:
        _PDL_DEVICES[x.device] = torch.cuda.get_device_capability(x.device)[0] >= 9
    return _PDL_DEVICES[x.device]


# early triggers (`pdl_launch_next`) in the one-token decode's weight-streaming kernels; MOELOOP_PDL_EARLY=off: each
# lets the next launch only after its own wait
PDL_EARLY = os.environ.get("MOELOOP_PDL_EARLY", "on").lower() != "off"


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword for a kernel that takes PDL=pdl (none without: older triton and the interpreter)."""
    return {"launch_pdl": True} if pdl else {}


def pdl_args(x: torch.Tensor, rows: int) -> dict:
    """The keywords of a decode kernel's launch over `rows` tokens: its PDL constexpr and, when on, launch_pdl."""
    pdl = pdl_applies(x, rows)
    return {"PDL": pdl, **pdl_launch(pdl)}


def rounds_by_bits(dtype: torch.dtype) -> bool:
    """Kernels round to bf16 with `bf16_rne` instead of a cast: under the interpreter, whose cast truncates."""
    return triton_interpreting() and dtype == torch.bfloat16


if triton is not None:
    import triton.language as tl

    @triton.jit
    def pdl_wait(PDL: tl.constexpr, EARLY: tl.constexpr = False):
        """With PDL: wait until the kernel launched before this one has completed (its stores visible), then let
        the next kernel launch (unless EARLY: `pdl_launch_next` did). Reads of that kernel's output and every store
        come after this."""
        if PDL:
            gdc_wait()
            if not EARLY:
                gdc_launch_dependents()

    @triton.jit
    def pdl_launch_next(PDL: tl.constexpr, EARLY: tl.constexpr):
        """With PDL and EARLY, at a kernel's start: let the next kernel launch now, so that it loads its weights
        while this one waits and runs. Only where no kernel after this one reads before its wait what this
        kernel's predecessor writes (the module docstring's rule)."""
        if PDL and EARLY:
            gdc_launch_dependents()

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
