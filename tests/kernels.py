"""Shared by the Triton kernel tests: the device their tensors live on (CUDA when there is one; on CPU the kernels
run under the interpreter that tests/conftest.py turns on) and the skip marks for where they cannot run."""
import os

import pytest
import torch

from moeloop.model.kernel_switch import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="triton is not installed" if triton is None else "no GPU and not under the Triton interpreter")


def counted_launches(monkeypatch, module, tag) -> list:
    """Forces `module`'s kernel path (CPU tensors run under the interpreter) and records `tag(*args, **kw)` of each
    call of its `_launch`, so a test can assert the kernels really ran."""
    calls = []
    launch = module._launch
    monkeypatch.setattr(module, "kernels_apply", lambda x: True)
    monkeypatch.setattr(module, "_launch", lambda *a, **k: calls.append(tag(*a, **k)) or launch(*a, **k))
    return calls


def recorded_grids(monkeypatch, module, names, tag) -> list:
    """Wraps each Triton kernel `module.<name>` so that every `kernel[grid](*args, **kw)` launch first appends
    `tag(name, grid, kw)` to the returned list, then runs as before."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(module, name)

        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append(tag(self.name, grid, kw))
                return self.kernel[grid](*args, **kw)
            return launch
    for name in names:
        monkeypatch.setattr(module, name, Recorder(name))
    return calls
