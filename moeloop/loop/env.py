"""`RunEnv`: process-level setup shared by the SFT and RL entrances — device, process group, seeds.

Under torchrun (RANK/WORLD_SIZE set) it initialises the default group (NCCL on GPU, gloo on CPU);
a test harness that already initialised a group is used as is.
"""
from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moeloop.config.schema import RunConfig
from moeloop.errors import InputError
from moeloop.parallel.groups import dp_rank, dp_size, init_parallel_groups

# how long a collective waits for the other ranks before the run fails (the default group's, and the parallel
# layouts' groups and meshes: torch's own default for those would be 30 minutes)
DIST_TIMEOUT = timedelta(minutes=10)


@dataclass
class RunEnv:
    """`rank` / `world_size`: of every process (each runs its own engine and generates its share); `dp_rank` /
    `dp_size`: of the data-parallel groups the trainer's data is sharded over (the ranks of one context-parallel
    group, `parallel.cp`, train on the same samples)."""
    device: torch.device
    rank: int
    world_size: int
    run_dir: Path

    @property
    def dp_rank(self) -> int:
        return dp_rank()

    @property
    def dp_size(self) -> int:
        return dp_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def create(cls, cfg: RunConfig) -> "RunEnv":
        device = _pick_device(cfg.trainer.device)
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # on GPUs, NCCL for CUDA tensors (FSDP, weight broadcast) and gloo for the loop's host-side sums and
            # object gathers (metrics, loss denominators, DAPO groups): NCCL alone rejects CPU tensors
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=DIST_TIMEOUT)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        p = cfg.parallel
        init_parallel_groups(p.cp, p.tp, p.pp, p.first_stage_layers, p.last_stage_layers, p.vpp, DIST_TIMEOUT,
                             p.sequence_parallel)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        seed_everything(cfg.trainer.seed + rank)
        run_dir = Path(cfg.trainer.run_dir)
        try:  # made first, so a path that cannot be one fails before any model is built
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"trainer.run_dir={run_dir}: cannot make the directory ({err.strerror})") from None
        return cls(device, rank, world, run_dir)


def _pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError("trainer.device=cuda but no CUDA device is visible")
    return torch.device(choice)


def check_parallel_support(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.etp != 1:
        raise InputError(f"parallel.etp={p.etp}: the trainer applies data, tensor, pipeline (interleaved too), expert "
                         f"and context parallelism only so far (torchrun --nproc_per_node N gives dp=N; parallel.tp "
                         f"splits the attention heads and dense MLPs over tp of them, parallel.pp the layers over pp "
                         f"stages, parallel.vpp each stage's into vpp chunks, parallel.ep the experts over ep of them, "
                         f"parallel.cp each sequence over cp of them); etp is used by `moeloop plan`")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def write_run_config(cfg: RunConfig, run_dir: Path, is_main: bool) -> None:
    """`<run_dir>/config.yaml`: the run's resolved, validated config (what `moeloop config show` prints), which
    `moeloop sft|rl <run_dir>/config.yaml` runs again. Written whole, then renamed; by the main rank."""
    if not is_main:
        return
    from moeloop.config import to_yaml
    partial = run_dir / "config.yaml.tmp"
    partial.write_text(to_yaml(cfg))
    partial.replace(run_dir / "config.yaml")


def load_tokenizer(cfg: RunConfig):
    """The tokenizer of the model folder at `model.path`. The folder is checked first: without it transformers
    would take the path for a hub id and fail with a message about repo names."""
    from moeloop.model.tokenizer import load_folder_tokenizer  # (transformers: imported when a command needs it)

    return load_folder_tokenizer(cfg.model.path, "model.path")


def training_steps(cfg: RunConfig, num_rows: int) -> int:
    """The run's step count: `trainer.steps`, or with `trainer.epochs` > 0 that many passes over the `num_rows` train
    rows, ceil(epochs * rows / data.train_batch_size) steps (the last step of a pass draws the next pass's first rows;
    DAPO's refills draw beyond a step's batch)."""
    if cfg.trainer.epochs <= 0:
        return cfg.trainer.steps
    return math.ceil(cfg.trainer.epochs * num_rows / cfg.data.train_batch_size)


def load_policy(cfg: RunConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model at `model.path` in `model.dtype`, with the run's gradient-checkpointing choice applied."""
    from moeloop.model.hf_io import load_pretrained

    model = load_pretrained(cfg.model.path, dtype=dtype_of(cfg.model.dtype), device=device)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    return model


def resume_from(ckpt, resume: bool, is_main: bool, path: str = ""):
    """The checkpoint a run continues from: `path` (checkpoint.resume_from: a step_N directory, or a checkpoints
    directory for its newest) when given; else with `--resume` the newest in `ckpt`'s directory, and with none there
    None (the run starts at step 0, as verl's auto resume does) and a note on stderr saying so. Without `--resume`,
    a checkpoint there gets a note on stderr: the run starts at step 0 all the same. The checkpoint taken is named
    on stderr too."""
    if path:
        chosen = Path(path)
        if (chosen / "latest").is_file():  # a checkpoints directory: its newest
            from moeloop.checkpoint import CheckpointManager
            chosen = CheckpointManager(chosen).latest() or chosen
        if not (chosen / "meta.json").is_file():
            raise InputError(f"checkpoint.resume_from={path}: not a checkpoint (a step_N directory with meta.json)")
        if is_main:
            print(f"checkpoint.resume_from: continuing from {chosen}", file=sys.stderr)
        return chosen
    latest = ckpt.latest()
    if not resume:
        if latest is not None and is_main:  # (a rerun that forgot --resume: it said nothing, and wrote over the logs)
            print(f"{latest}: not resumed (without --resume); this run starts at step 0", file=sys.stderr)
        return None
    if is_main:
        print(f"--resume: no checkpoint in {ckpt.directory}; starting at step 0" if latest is None
              else f"--resume: continuing from {latest}", file=sys.stderr)
    return latest


def run_command(argv: list[str], name: str, run) -> int:
    """`moeloop NAME CONFIG [key=value ...] [--resume]`: load the config, call `run(cfg, resume)`."""
    from moeloop.config import load_config

    usage = f"usage: moeloop {name} CONFIG [key=value ...] [--resume]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    resume = "--resume" in argv
    args = [a for a in argv if a != "--resume"]
    flags = [a for a in args if a.startswith("-")]  # (an override is key=value; --help was taken for the config file)
    if not args or flags:
        print(f"moeloop {name}: unknown option {flags[0]}\n{usage}" if flags else usage, file=sys.stderr)
        return 2
    run(load_config(args[0], args[1:]), resume)
    return 0
