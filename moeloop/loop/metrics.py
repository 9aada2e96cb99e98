"""Per-step metrics: phase timers, and one logger that writes the console line, JSONL and TensorBoard.

    timer = PhaseTimer()
    with timer("gen"): ...
    logger.log(step, {**timer.pop(), **other_metrics})
Phase names follow the design: gen, reward, old_log_prob, ref, values (critic), adv, update_critic,
update_actor, update_weights, save_checkpoint. Only rank 0 writes.
"""
from __future__ import annotations

import importlib
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from moeloop.errors import InputError

PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
          "save_checkpoint")


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Times the phase, waiting for the calling thread's CUDA stream at both ends if this process uses CUDA (a
        CPU run on a GPU machine does not, and a synchronize would initialise it: a context per rank, and an error in
        a rank forked from a process that had one). The stream, not the device: the async rollout thread's kernels
        on its own stream must not stall the trainer's phases, nor the trainer's the thread's."""
        sync = torch.cuda.is_initialized()
        if sync:
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.current_stream().synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        self.seconds = {}
        return out


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _sink_module(sink: str, module: str):
    """The module a `trainer.log` sink writes through; an InputError naming the sink when its package is missing
    (wandb is optional)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise InputError(f"trainer.log: the {sink} sink needs the {sink} package ({err}); pip install {sink}, or "
                         f"leave {sink} out of trainer.log") from None


RUN_FILES = ("metrics.jsonl", "val.jsonl", "val_generations.jsonl")  # the JSONL files a run writes in its run_dir


class MetricsLogger:
    """`trainer.log` picks sinks: console, jsonl, tensorboard, wandb."""

    def __init__(self, run_dir: str | Path, sinks: list[str], enabled: bool = True, total_steps: int = 0,
                 append: bool = False, wandb_init: dict | None = None):
        """`append`: continue the run's JSONL files and TensorBoard events (resume; `start_at` drops what they hold
        past the step resumed from); otherwise a fresh run starts them anew (`RUN_FILES` and tb/'s event files only:
        other files in the run directory, a dataset say, are left alone). `wandb_init`: wandb.init's arguments
        beyond `dir` (project, name, config)."""
        self.run_dir, self.sinks, self.enabled, self.total_steps = Path(run_dir), set(sinks), enabled, total_steps
        self._tb = self._wandb = self._bar = None
        self._append, self._started = append, False
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.sinks:
            self._summary_writer = _sink_module("tensorboard", "torch.utils.tensorboard").SummaryWriter
        if not append:
            for name in RUN_FILES:
                (self.run_dir / name).unlink(missing_ok=True)
            for old in (self.run_dir / "tb").glob("events.out.tfevents.*"):  # (TensorBoard would overlay them)
                old.unlink()
        if "wandb" in self.sinks:
            self._wandb = _sink_module("wandb", "wandb").init(**{"project": "moeloop", **(wandb_init or {}),
                                                                  "dir": str(self.run_dir)})

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, is_main: bool, append: bool) -> "MetricsLogger":
        """The logger of an SFT or RL run: `trainer.log`'s sinks over `trainer.steps`; W&B gets trainer.project_name,
        trainer.experiment_name (or the run directory's name) and the resolved config as the run's config."""
        from omegaconf import OmegaConf
        t = cfg.trainer
        wandb_init = {"project": t.project_name, "name": t.experiment_name or Path(run_dir).resolve().name,
                      "config": OmegaConf.to_container(OmegaConf.structured(cfg))} if "wandb" in t.log else None
        return cls(run_dir, t.log, is_main, t.steps, append=append, wandb_init=wandb_init)

    def start_at(self, step: int) -> None:
        """The run's steps start after `step`, as its first step begins. A resumed run's files first lose the rows
        (and TensorBoard the events) past `step`: the run that stopped logged them after the checkpoint it resumes
        from, and they are logged again. Opens the console progress bar at `step` of `total_steps`, so its rate
        counts the first step's time."""
        if self.enabled and not self._started:
            self._started = True
            if self._append:
                self._drop_rows_after(step)
            self._open_tb(purge_step=step + 1 if self._append else None)
        self._open_bar(step)

    def _open_bar(self, step: int) -> None:
        if self.enabled and "console" in self.sinks and self.total_steps and self._bar is None:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_steps, initial=step, dynamic_ncols=True, leave=True)

    def _drop_rows_after(self, step: int) -> None:
        for name in RUN_FILES:
            path = self.run_dir / name
            if path.is_file():
                lines = [line for line in path.read_text().splitlines() if line.strip()]
                kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
                if len(kept) < len(lines):
                    path.write_text("".join(line + "\n" for line in kept))

    def _open_tb(self, purge_step: int | None = None) -> None:
        if "tensorboard" in self.sinks and self._tb is None:
            self._tb = self._summary_writer(str(self.run_dir / "tb"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float], file: str = "metrics.jsonl") -> None:
        if not self.enabled:
            return
        self._open_tb()  # (logged before `start_at`: no purge)
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if "jsonl" in self.sinks:
            with open(self.run_dir / file, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if "console" in self.sinks and file == "metrics.jsonl":
            self._console(step, record)
        elif "console" in self.sinks and file == "val.jsonl":  # (its own line: the step line shows acc/val only)
            self.note(f"validation at step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in record.items() if k != "step"),
                      sys.stdout)

    def note(self, text: str, stream: Any = None) -> None:
        """One line on stderr (or `stream`), above the progress bar, which stays intact; from the main rank."""
        if not self.enabled:
            return
        stream = stream or sys.stderr
        if self._bar is not None:
            self._bar.write(text, file=stream)
        else:
            print(text, file=stream, flush=True)

    def _console(self, step: int, record: dict[str, float]) -> None:
        keys = ("reward/mean", "acc/train", "acc/val", "sft_loss", "val/sft_loss", "pg_loss", "kl_mean", "entropy",
                "response/len_mean", "throughput/samples_per_s", "time/step")
        labels = {"val/sft_loss": "val_loss"}
        line = " ".join(f"{labels.get(k, k.split('/')[-1])}={record[k]:.4g}" for k in keys if k in record)
        if self._bar is None:  # (no `start_at` call: the bar starts at this step)
            self._open_bar(step - 1)
        if self._bar is not None:
            self._bar.set_postfix_str(line, refresh=False)
            self._bar.update(1)
        else:
            print(f"step {step}: {line}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
