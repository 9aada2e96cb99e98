"""Ctrl-C in `moeloop sft|rl`: one line on stderr naming the newest checkpoint, exit code 130, the run's cleanup run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeloop.cli import main as cli_main
from moeloop.model.factory import init_model

ROOT = Path(__file__).resolve().parents[1]

RUNS = {"rl": (str(ROOT / "examples/tiny.yaml"), "moeloop.loop.rl.run_rl"),
        "sft": (str(ROOT / "examples/tiny_sft.yaml"), "moeloop.loop.sft.run_sft")}


def interrupt_run(monkeypatch: pytest.MonkeyPatch, target: str) -> list[str]:
    """Replace the run function at `target` by one that Ctrl-C stops; returns the list its `finally:` appends to."""
    cleaned: list[str] = []

    def run(cfg: object, resume: bool = False) -> None:
        try:
            raise KeyboardInterrupt
        finally:
            cleaned.append("closed")

    monkeypatch.setattr(target, run)
    return cleaned


class FailsToClose:
    """As torch.save's zip writer when Ctrl-C stops it mid-record: closing raises a RuntimeError, in whose
    __context__ the KeyboardInterrupt is."""

    def __enter__(self) -> "FailsToClose":
        return self

    def __exit__(self, *exc: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 270 vs 240")


class Interrupts:
    """Ctrl-C while DCP writes this object (pickles it), plain or with the writer failing to close after it."""

    def __init__(self, close_fails: bool) -> None:
        self.close_fails = close_fails

    def __reduce__(self) -> tuple:
        if self.close_fails:
            with FailsToClose():
                raise KeyboardInterrupt
        raise KeyboardInterrupt


def save_fake_checkpoint(directory: Path, step: int) -> Path:
    """What `CheckpointManager.latest` looks for: step_N/meta.json and the `latest` pointer."""
    path = directory / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text('{"step": %d}' % step)
    (directory / "latest").write_text(path.name)
    return path


@pytest.mark.parametrize("command", ["rl", "sft"])
def test_ctrl_c_without_a_checkpoint_prints_one_line_and_exits_130(command: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config, target = RUNS[command]
    cleaned = interrupt_run(monkeypatch, target)
    assert cli_main([command, config, f"trainer.run_dir={tmp_path}"]) == 130
    err = capsys.readouterr().err  # all of stderr: one line, no traceback
    assert err == f"moeloop {command}: interrupted; no checkpoint was saved in {tmp_path / 'checkpoints'}\n"
    assert cleaned == ["closed"]


@pytest.mark.parametrize("command", ["rl", "sft"])
def test_ctrl_c_names_the_newest_checkpoint(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint directory of the resolved config (here checkpoint.dir), its newest complete save."""
    config, target = RUNS[command]
    save_fake_checkpoint(tmp_path / "ckpts", 2)
    newest = save_fake_checkpoint(tmp_path / "ckpts", 4)
    interrupt_run(monkeypatch, target)
    argv = [command, config, f"trainer.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpts'}", "--resume"]
    assert cli_main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"moeloop {command}: interrupted; the newest checkpoint is {newest} (resume with --resume)\n"


def test_ctrl_c_under_torchrun_only_rank_0_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank ends with 130 (torchrun then reports the run as interrupted); one line in all."""
    cleaned = interrupt_run(monkeypatch, RUNS["rl"][1])
    argv = ["rl", RUNS["rl"][0], f"trainer.run_dir={tmp_path}"]
    monkeypatch.setenv("RANK", "1")
    assert cli_main(argv) == 130 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli_main(argv) == 130 and capsys.readouterr().err.startswith("moeloop rl: interrupted; no checkpoint")
    assert cleaned == ["closed", "closed"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (DCP in one process, as the manager saves)
@pytest.mark.parametrize("close_fails", [False, True])
def test_ctrl_c_during_a_checkpoint_save(close_fails: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """DCP hands the KeyboardInterrupt back inside a CheckpointException (a BaseException), or the RuntimeError a
    half-written file raised on closing after it (3 of 40 SIGINTs to a real run saving each step did): still one line
    and 130."""
    import torch.distributed.checkpoint as dcp

    def run(cfg: object, resume: bool = False) -> None:
        dcp.save({"x": Interrupts(close_fails)}, checkpoint_id=str(tmp_path / "checkpoints" / "step_000001.tmp"))

    monkeypatch.setattr("moeloop.loop.sft.run_sft", run)
    assert cli_main(["sft", RUNS["sft"][0], f"trainer.run_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err == f"moeloop sft: interrupted; no checkpoint was saved in {tmp_path / 'checkpoints'}\n"


def test_sigint_to_a_real_sft_run(tmp_path: Path) -> None:
    """`python -m moeloop sft` on a tiny model, SIGINT after its first checkpoint (a save each step, so the signal
    often lands in one): exit code 130 and one line on stderr naming the newest checkpoint. About 10 s."""
    sigint_after_first_checkpoint(tmp_path, "sft", ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"])


def test_ctrl_c_to_a_run_with_worker_processes(tmp_path: Path) -> None:
    """`moeloop rl` with its engine in a process of its own (`rollout.mode=disaggregated`) and the rewards in process
    workers (`reward.executor=process`); SIGINT to the whole process group after the first checkpoint, as a terminal's
    Ctrl-C: the workers end quietly (no traceback of theirs), the run prints its one line, and no process of the
    group is left. About 15 s."""
    sigint_after_first_checkpoint(tmp_path, "rl", [
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "trainer.val_every=0",
        "data.val_files=[]", "rollout.mode=disaggregated", "reward.executor=process", "reward.concurrency=4"],
        group=True)


def sigint_after_first_checkpoint(tmp_path: Path, command: str, overrides: list[str], group: bool = False) -> None:
    """Run `python -m moeloop COMMAND` on a tiny model with a checkpoint every step; after the first, SIGINT to it
    (`group`: to its whole process group, in a session of its own); then check exit code 130, one line on stderr
    naming the newest checkpoint, no traceback, and (`group`) no process of the group left."""
    init_model("qwen3_moe", "tiny", tmp_path / "model", seed=1)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moeloop", command, RUNS[command][0], f"model.path={tmp_path / 'model'}",
           f"trainer.run_dir={run_dir}", "trainer.device=cpu", "trainer.steps=1000", "trainer.log=[jsonl]",
           "checkpoint.save_every=1", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")

    def start() -> None:  # SIGINT as Python installs it: a shell's background job would otherwise pass it on ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if group:
            os.setsid()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=start)
    latest = run_dir / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 120
        while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its first checkpoint:\n{proc.stderr.read()[-3000:]}")
        assert latest.is_file(), "no checkpoint within 120 s"
        if group:
            assert len(_group(proc.pid)) > 2, "the run started no worker processes"  # (the engine, reward workers)
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            (os.killpg if group else os.kill)(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    newest = latest.parent / latest.read_text().strip()
    assert err.splitlines()[-1] == (f"moeloop {command}: interrupted; the newest checkpoint is {newest} "
                                    "(resume with --resume)")
    assert "Traceback" not in err, err[-3000:]
    if group:
        deadline = time.monotonic() + 10
        while _group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group(proc.pid), f"left running: {_group(proc.pid)}"


def _group(pgid: int) -> list[str]:
    """The command lines of the processes in process group `pgid`."""
    ps = subprocess.run(["ps", "-eo", "pgid=,args="], capture_output=True, text=True, check=True).stdout
    return [line.split(None, 1)[1] for line in ps.splitlines() if line.split(None, 1)[0] == str(pgid)]
