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


def test_env_tile_wants_powers_of_two_for_block_sizes_and_warps(monkeypatch):
    """Block sizes and warps must be powers of two (a tl.arange extent, num_warps): "6,4" is refused naming the
    variable; a count such as pipeline stages may take any positive value."""
    import pytest
    from moeloop.model.kernel_switch import env_tile
    monkeypatch.setenv("MOELOOP_GATE_UP_TILE", "6,4")
    with pytest.raises(ValueError, match="MOELOOP_GATE_UP_TILE.*power of two"):
        env_tile("MOELOOP_GATE_UP_TILE", (8, 4))
    monkeypatch.setenv("MOELOOP_PAGED_STAGES", "5")
    assert env_tile("MOELOOP_PAGED_STAGES", (3,), powers_of_two=False) == (5,)


def test_every_b1_tile_knob_reads_its_variable():
    """Each tile `benchmarks/b1_tiles.py` sweeps can be set from the environment (fresh interpreter, variables set
    before import), so a sweep's best on another GPU applies without a code change; a bad value fails the import
    naming its variable."""
    import os
    import subprocess
    import sys
    env_values = {"MOELOOP_ROW_LINEAR_TILE": ("fused_decode", "ROW_LINEAR_TILE", "16,8", (16, 8)),
                  "MOELOOP_O_PROJ_TILE": ("fused_decode", "O_PROJ_TILE", "8,1", (8, 1)),
                  "MOELOOP_ROUTER_TILE": ("fused_decode", "ROUTER_TILE", "2,1", (2, 1)),
                  "MOELOOP_LM_HEAD_TILE": ("fused_decode", "LM_HEAD_TILE", "16,4", (16, 4)),
                  "MOELOOP_GATE_UP_TILE": ("moe_kernel", "GATE_UP_FEW_TILE", "4,8", (4, 8)),
                  "MOELOOP_DOWN_TILE": ("moe_kernel", "DOWN_FEW_TILE", "2,2", (2, 2)),
                  "MOELOOP_PAGED_BLOCK_N": ("decode_kernel", "PAGED_BLOCK_N", "32", 32),
                  "MOELOOP_MAX_SPLITS": ("decode_kernel", "MAX_SPLITS", "3", 3),
                  "MOELOOP_PAGED_STAGES": ("decode_kernel", "PAGED_STAGES", "5", 5),
                  "MOELOOP_PAGED_WARPS_ONE_ROW": ("decode_kernel", "PAGED_WARPS_ONE_ROW", "2", 2),
                  "MOELOOP_MERGE_WARPS": ("decode_kernel", "MERGE_WARPS", "4", 4)}
    check = ("from moeloop.rollout import decode_kernel, fused_decode, moe_kernel\n"
             + "".join(f"assert {mod}.{attr} == {want!r}, ({mod!r}, {attr!r}, {mod}.{attr})\n"
                       for mod, attr, _, want in env_values.values()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOELOOP_")}
    env.update({var: raw for var, (_, _, raw, _) in env_values.items()})
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    env["MOELOOP_DOWN_TILE"] = "3,4"
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "MOELOOP_DOWN_TILE='3,4'" in run.stderr
