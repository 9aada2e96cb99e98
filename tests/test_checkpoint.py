"""Checkpoints: atomic saves, resume == uninterrupted, and a DP=2 checkpoint resumes at DP=1 and DP=4."""
import os
import re
import shutil
import warnings

import pytest

import torch

from moeloop.checkpoint import CheckpointManager
from moeloop.data import EpochCursor
from moeloop.loop.sft import actor_state_load, actor_state_save
from moeloop.train.actor import Actor
from tests.dist import run_ranks
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model

ADAM_ATOL = 2e-5  # Adam normalises tiny fp32 differences of all-reduced gradients (see notes/cpu-stack.md)


def _share(samples, rank, world):
    groups = sorted({s.group_id for s in samples})
    return [s for s in samples if groups.index(s.group_id) % world == rank]


def _actor():
    return Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=24), torch.device("cpu"), 8, total_steps=4)


def _run(rank, world, ckpt_dir, steps, resume_from=None, save_at=None):
    actor, cursor = _actor(), EpochCursor(100, seed=1)
    start = 0
    if resume_from:
        meta = actor_state_load(CheckpointManager(ckpt_dir), CheckpointManager(ckpt_dir).latest(), actor, cursor)
        start = meta["step"]
    for step in range(start, steps):
        cursor.take(4)
        actor.update(_share(rl_batch(seed=step), rank, world))
        if save_at == step + 1:
            actor_state_save(CheckpointManager(ckpt_dir), step + 1, actor, cursor)
    return {n: t.clone() for n, t in actor.named_weights()}, cursor.state_dict(), actor.scheduler.last_epoch


def _dist_run(rank, world, ckpt_dir, steps, resume_from, save_at):
    return _run(rank, world, ckpt_dir, steps, resume_from, save_at)


def _assert_same(a, b, atol=ADAM_ATOL):
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol)


def test_resume_equals_straight_run(tmp_path):
    straight, cursor_s, sched_s = _run(0, 1, tmp_path / "a", 4)
    _run(0, 1, tmp_path / "b", 2, save_at=2)
    resumed, cursor_r, sched_r = _run(0, 1, tmp_path / "b", 4, resume_from=True)
    _assert_same(straight, resumed, atol=0)  # single process: bit-exact
    assert cursor_s == cursor_r and sched_s == sched_r


def test_save_is_atomic_and_pruned(tmp_path):
    actor, cursor = _actor(), EpochCursor(10)
    ckpt = CheckpointManager(tmp_path, keep=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            actor_state_save(ckpt, step, actor, cursor)
        ckpt.load(ckpt.latest(), actor.model, actor.optimizer)
    assert not [w for w in caught if "torch.distributed is" in str(w.message)]  # (DCP's one-process note: not here)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    # a save killed half-way leaves a .tmp directory; the previous checkpoint stays the latest
    (tmp_path / "step_000004.tmp").mkdir()
    (tmp_path / "step_000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert ckpt.latest().name == "step_000003"
    meta = ckpt.load(ckpt.latest(), actor.model, actor.optimizer)
    assert meta["step"] == 3 and meta["cursor"]["num_rows"] == 10
    # a fresh run in the directory of an earlier, longer one: its own checkpoints are the ones kept and resumed
    shutil.copytree(tmp_path / "step_000003", tmp_path / "step_000040")
    actor_state_save(ckpt, 1, actor, cursor)
    assert ckpt.latest().name == "step_000001" and (tmp_path / "step_000040").is_dir()


def test_resume_takes_the_latest_or_says_it_starts_fresh(tmp_path, capsys):
    """`--resume` (`resume_from`): the newest complete checkpoint; with none, step 0 and a note on stderr (from
    the main rank only), and the one taken named there; without --resume, nothing is read, and a checkpoint there gets
    a note."""
    from moeloop.loop.env import resume_from
    ckpt = CheckpointManager(tmp_path / "ckpt")
    assert resume_from(ckpt, True, is_main=True) is None
    assert capsys.readouterr().err == f"--resume: no checkpoint in {tmp_path / 'ckpt'}; starting at step 0\n"
    assert resume_from(ckpt, True, is_main=False) is None and capsys.readouterr().err == ""
    actor_state_save(ckpt, 3, _actor(), EpochCursor(10))
    assert resume_from(ckpt, True, is_main=True).name == "step_000003"
    assert capsys.readouterr().err == f"--resume: continuing from {ckpt.latest()}\n"
    assert resume_from(ckpt, False, is_main=True, path=str(tmp_path / "ckpt")).name == "step_000003"
    assert capsys.readouterr().err == f"checkpoint.resume_from: continuing from {ckpt.latest()}\n"
    assert resume_from(ckpt, False, is_main=True) is None
    assert capsys.readouterr().err == f"{ckpt.latest()}: not resumed (without --resume); this run starts at step 0\n"


@pytest.mark.parametrize("initialised", [False, True])
def test_rng_state_touches_cuda_only_once_the_run_has(monkeypatch, initialised):
    """A CPU run on a GPU machine saves and restores no CUDA RNG state, so CUDA stays uninitialised (a rank forked
    from a parent that initialised it could not); a run that uses CUDA saves and restores its device's state."""
    from moeloop.checkpoint import rng_state, set_rng_state
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: calls.append("get") or torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: calls.append("set"))
    state = rng_state()
    set_rng_state({**state, "cuda": torch.zeros(16, dtype=torch.uint8)})
    assert ("cuda" in state) == initialised
    assert calls == (["get", "set"] if initialised else [])


@pytest.mark.parametrize("resume_world", [1, 4])
def test_dp2_checkpoint_resumes_at_other_layouts(tmp_path, resume_world):
    straight = run_ranks(_dist_run, 2, str(tmp_path / "a"), 4, None, None)[0][0]
    run_ranks(_dist_run, 2, str(tmp_path / "b"), 2, None, 2)
    assert sorted(os.listdir(tmp_path / "b" / "step_000002")).count("meta.json") == 1
    if resume_world == 1:
        resumed = _run(0, 1, str(tmp_path / "b"), 4, resume_from=True)[0]
    else:
        resumed = run_ranks(_dist_run, resume_world, str(tmp_path / "b"), 4, True, None)[0][0]
    _assert_same(straight, resumed)


def test_ckpt_export_cli_writes_loadable_hf(tmp_path):
    from moeloop.checkpoint.command import main as ckpt_main
    from moeloop.model.factory import init_model
    from moeloop.model.hf_io import load_pretrained
    import transformers

    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m", seed=1)
    model = load_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # differs from model_dir's weights
    CheckpointManager(tmp_path / "ckpt").save(1, model, None, {"cursor": {}})
    assert ckpt_main(["export", str(tmp_path / "ckpt"), "--model", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(hf.lm_head.weight, model.lm_head.weight)



def test_a_checkpoint_of_another_model_is_named_not_a_dcp_traceback(tmp_path, capsys):
    """Exporting (or resuming) a checkpoint with another model's folder: one line naming the checkpoint, the missing
    or reshaped tensors, exit 2 (DCP raised 'Missing key in checkpoint state_dict' from deep in its planner)."""
    from moeloop.cli import main as cli_main
    from moeloop.model.factory import init_model
    from moeloop.model.hf_io import load_pretrained

    qwen = init_model("qwen3_moe", "tiny", tmp_path / "qwen", seed=1)
    CheckpointManager(tmp_path / "ckpt").save(1, load_pretrained(qwen), None, {"cursor": {}})
    for other, message in ((init_model("deepseek_v3", "tiny", tmp_path / "ds", seed=1), r"tensors missing \(e.g. model\."),
                           (init_model("qwen3_moe", "small", tmp_path / "small", seed=1),
                            r"model.embed_tokens.weight \(128, 64\) saved, \(128, 128\) here")):
        assert cli_main(["ckpt", "export", str(tmp_path / "ckpt"), "--model", str(other), "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "this checkpoint does not fit the model" in err and re.search(message, err) and "Traceback" not in err
