"""MOELOOP_KERNELS=off turns every CUDA-side Triton path of the model and the engine back to torch ops."""
from types import SimpleNamespace

import torch

from moeloop.model.expert_rows import row_kernels_apply
from moeloop.model.kernel_switch import kernels_enabled
from moeloop.model.logprob_kernels import kernels_apply
from moeloop.model.norm import fused_rmsnorm_applies
from moeloop.model.norm import triton as norm_triton


def test_switch_turns_the_kernel_paths_off(monkeypatch):
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # what the predicates look at
    weight = SimpleNamespace(dtype=torch.bfloat16)
    monkeypatch.delenv("MOELOOP_KERNELS", raising=False)
    assert kernels_enabled()
    on = [row_kernels_apply(cuda_like), kernels_apply(cuda_like), fused_rmsnorm_applies(cuda_like, weight)]
    assert on == [norm_triton is not None] * 3  # on wherever triton is installed
    monkeypatch.setenv("MOELOOP_KERNELS", "off")
    assert not kernels_enabled()
    assert [row_kernels_apply(cuda_like), kernels_apply(cuda_like), fused_rmsnorm_applies(cuda_like, weight)] == [False] * 3


def test_pdl_only_compiled_on_hopper_and_not_when_switched_off(monkeypatch):
    """Programmatic dependent launch: never under the interpreter or on CPU tensors; on a CUDA device, from
    compute capability 9, for at most PDL_MAX_ROWS rows, unless MOELOOP_PDL=off."""
    from moeloop.model import kernel_switch
    monkeypatch.delenv("MOELOOP_PDL", raising=False)
    assert not kernel_switch.pdl_applies(torch.zeros(1), 1)
    assert kernel_switch.pdl_launch(False) == {} and kernel_switch.pdl_launch(True) == {"launch_pdl": True}
    cuda_like = SimpleNamespace(is_cuda=True, device="fake:0")
    monkeypatch.setattr(kernel_switch, "_PDL_DEVICES", {"fake:0": True})
    monkeypatch.setattr(kernel_switch, "gdc_wait", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not kernel_switch.pdl_applies(cuda_like, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel_switch.pdl_applies(cuda_like, 1)
    assert kernel_switch.pdl_applies(cuda_like, kernel_switch.PDL_MAX_ROWS)
    assert not kernel_switch.pdl_applies(cuda_like, kernel_switch.PDL_MAX_ROWS + 1)  # a large batch
    monkeypatch.setenv("MOELOOP_PDL", "off")
    assert not kernel_switch.pdl_applies(cuda_like, 1)
    monkeypatch.setattr(kernel_switch, "_PDL_DEVICES", {"fake:0": False})  # an Ampere card
    monkeypatch.delenv("MOELOOP_PDL")
    assert not kernel_switch.pdl_applies(cuda_like, 1)


def test_env_tile_reads_a_tile_or_names_the_variable(monkeypatch):
    """A tile's A/B variable ("rows,warps"): unset gives the default; a malformed or wrong-length value raises
    naming the variable, not a bare int() error."""
    import pytest
    from moeloop.model.kernel_switch import env_tile
    monkeypatch.delenv("MOELOOP_O_PROJ_TILE", raising=False)
    assert env_tile("MOELOOP_O_PROJ_TILE", (2, 2)) == (2, 2)
    monkeypatch.setenv("MOELOOP_O_PROJ_TILE", "8,4")
    assert env_tile("MOELOOP_O_PROJ_TILE", (2, 2)) == (8, 4)
    for bad in ("8", "8,x", "8,4,2", "0,4", ""):
        monkeypatch.setenv("MOELOOP_O_PROJ_TILE", bad)
        with pytest.raises(ValueError, match="MOELOOP_O_PROJ_TILE"):
            env_tile("MOELOOP_O_PROJ_TILE", (2, 2))
