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
    monkeypatch.setenv("MOELOOP_GATE_UP_FEW_TILE", "6,4")
    with pytest.raises(ValueError, match="MOELOOP_GATE_UP_FEW_TILE.*power of two"):
        env_tile("MOELOOP_GATE_UP_FEW_TILE", (8, 4))
    monkeypatch.setenv("MOELOOP_PAGED_STAGES", "5")
    assert env_tile("MOELOOP_PAGED_STAGES", (3,), powers_of_two=False) == (5,)


def test_every_b1_tile_knob_reads_its_variable():
    """Each knob `benchmarks/b1_tiles.py` sweeps can be set from the environment, through the variable its
    `env_setting` prints (fresh interpreters, variables set before import), so a sweep's best on another GPU applies
    without a code change; a knob added to the sweep without a variable fails here. A bad value fails the import
    naming its variable."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOELOOP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "benchmarks"), env.get("PYTHONPATH", "")])
    # per knob: its module, constant, a swept value other than the default, and that value's setting
    listing = ("import json, b1_tiles\n"
               "rows = []\n"
               "for name, (mod, attr, values) in b1_tiles.KNOBS.items():\n"
               "    value = next(v for v in values if v != getattr(mod, attr))\n"
               "    rows.append([mod.__name__, attr, value, b1_tiles.env_setting(name, value)])\n"
               "print(json.dumps(rows))\n")
    run = subprocess.run([sys.executable, "-c", listing], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    knobs = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(knobs) >= 12
    check = "import importlib\n" + "".join(
        f"got = getattr(importlib.import_module({mod!r}), {attr!r})\n"
        f"assert list(got) == {value!r} if isinstance(got, tuple) else got == {value!r}, ({attr!r}, got)\n"
        for mod, attr, value, _ in knobs)
    env.update(setting.split("=", 1) for *_, setting in knobs)
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    env["MOELOOP_DOWN_FEW_TILE"] = "3,4"
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "MOELOOP_DOWN_FEW_TILE='3,4'" in run.stderr
