"""Keep part of the lm_head weight in the GPU's L2 cache from one decode step to the next (CUDA access-policy window
with persisting hits), so that a step reads those bytes from L2 instead of HBM. Off by default, an experiment:
`MOELOOP_L2_PERSIST=lm_head` turns it on.

Why the lm_head: at B=1 a decode step streams every weight once (0.6 GB at the reference shape), far more than the
L2 holds, so nothing survives to the next step by itself. The lm_head is the largest single tensor (98 MB at the
reference shape) and the one kernel that reads at full bandwidth; a window over it with a hit ratio of
(set-aside bytes / its bytes) keeps that share of its lines in the L2's set-aside part across steps.

How: the device's persisting set-aside (`cudaLimitPersistingL2CacheSize`) is sized once, and the decode graphs are
captured on a stream that carries the window (`cudaStreamAttributeAccessPolicyWindow`): capture copies the
stream's window into every kernel node. `release` demotes the persisting lines (`cudaCtxResetPersistingL2Cache`),
for when the graphs are dropped (sleep: training gets the whole L2 back). The CUDA runtime is reached with ctypes,
from the libcudart torch has loaded.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

from moeloop.errors import InputError

_CHOICES = ("off", "lm_head")
L2_PERSIST = os.environ.get("MOELOOP_L2_PERSIST", "off").lower()

# CUDA runtime enum values (driver_types.h)
_STREAM_ATTR_ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow (= cudaLaunchAttributeAccessPolicyWindow)
_ACCESS_NORMAL, _ACCESS_STREAMING, _ACCESS_PERSISTING = 0, 1, 2  # cudaAccessProperty
_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
_ATTR_MAX_WINDOW = 109  # cudaDevAttrMaxAccessPolicyWindowSize


class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _StreamAttrValue(ctypes.Union):  # cudaStreamAttrValue (cudaLaunchAttributeValue: a 64-byte union)
    _fields_ = [("accessPolicyWindow", _AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


def choice() -> str:
    """The `MOELOOP_L2_PERSIST` setting, checked."""
    if L2_PERSIST not in _CHOICES:
        raise InputError(f"MOELOOP_L2_PERSIST must be one of {', '.join(_CHOICES)}; got {L2_PERSIST!r}")
    return L2_PERSIST


def hit_ratio(window_bytes: int, set_aside_bytes: int) -> float:
    """The share of a window's lines marked persisting: all of it when it fits the set-aside, else the share that
    fits (a larger share makes the persisting lines evict each other)."""
    return 1.0 if window_bytes <= set_aside_bytes else set_aside_bytes / window_bytes


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch has loaded (found in this process's mappings), else the loader's."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return ctypes.CDLL(path)
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise RuntimeError("MOELOOP_L2_PERSIST: no libcudart in this process or on the loader path")
    return ctypes.CDLL(found)


def _check(err: int, what: str) -> None:
    if err != 0:
        rt = _cudart()
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {rt.cudaGetErrorString(err).decode()} ({err})")


def _device_attr(attr: int, device: int) -> int:
    value = ctypes.c_int()
    _check(_cudart().cudaDeviceGetAttribute(ctypes.byref(value), attr, device), "cudaDeviceGetAttribute")
    return value.value


class L2Window:
    """A persisting window over `tensor`, sized to the device's largest set-aside and window."""

    def __init__(self, tensor: torch.Tensor):
        device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        self.tensor = tensor
        self.set_aside = _device_attr(_ATTR_MAX_PERSISTING_L2, device)
        self.num_bytes = min(tensor.numel() * tensor.element_size(), _device_attr(_ATTR_MAX_WINDOW, device))
        self.hit_ratio = hit_ratio(self.num_bytes, self.set_aside)
        with torch.cuda.device(device):
            _check(_cudart().cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(self.set_aside)),
                   "cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize)")

    def apply(self, stream: torch.cuda.Stream) -> None:
        """Give `stream` the window: kernels launched (or captured) on it mark their hits in it persisting."""
        value = _StreamAttrValue()
        value.accessPolicyWindow = _AccessPolicyWindow(self.tensor.data_ptr(), self.num_bytes, self.hit_ratio,
                                                       _ACCESS_PERSISTING, _ACCESS_STREAMING)
        _check(_cudart().cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _STREAM_ATTR_ACCESS_POLICY_WINDOW,
                                                ctypes.byref(value)), "cudaStreamSetAttribute(accessPolicyWindow)")

    @staticmethod
    def release() -> None:
        """Demote every persisting line to normal (the graphs that marked them are gone)."""
        _check(_cudart().cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")


def window_for(model: torch.nn.Module) -> L2Window | None:
    """The decode graphs' window under `MOELOOP_L2_PERSIST` (None when off or the model is not on CUDA)."""
    if choice() == "off":
        return None
    weight = model.lm_head.weight
    return L2Window(weight) if weight.is_cuda else None
