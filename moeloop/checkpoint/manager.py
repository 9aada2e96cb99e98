"""`CheckpointManager`: atomic DCP checkpoints of model + optimizer + run state, loadable at any layout.

Layout on disk:
    <dir>/step_000010/         DCP files (*.distcp + .metadata), sharded however the run was
    <dir>/step_000010/meta.json  step, layout, data cursor, scheduler, extra run state
    <dir>/step_000010/rng/rank{r}.pt  each rank's RNG states
    <dir>/latest               name of the newest complete checkpoint
Every rank writes into `step_N.tmp/`; after a barrier rank 0 renames it and rewrites `latest`
(write-then-rename), so a save killed half-way leaves the previous checkpoint the latest one.
`trainable_only` (LoRA) saves and loads the parameters that train (and their optimizer state) only: the frozen
ones are model.path's, loaded with the model.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from moeloop.errors import InputError
from moeloop.parallel.groups import pp_rank, pp_size
from moeloop.parallel.pipeline import tied_copy


def _check_fits(path: Path, model_sd: dict[str, Any]) -> None:
    """An InputError naming the checkpoint when the model's tensors are not all in it at their shapes (saved from
    another model or config), before DCP's load would fail on the first one."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [name for name in model_sd if f"model.{name}" not in saved]
    reshaped = [f"{name} {tuple(saved[f'model.{name}'].size)} saved, {tuple(t.shape)} here"
                for name, t in model_sd.items()
                if f"model.{name}" in saved and tuple(getattr(saved[f"model.{name}"], "size", t.shape)) != tuple(t.shape)]
    if missing or reshaped:
        problems = ([f"{len(missing)} tensors missing (e.g. {missing[0]})"] if missing else []) + reshaped[:2]
        raise InputError(f"{path}: this checkpoint does not fit the model ({'; '.join(problems)}): was it saved from "
                         f"another model or config?")


TIED_NAME = "model.embed_tokens.weight"  # a head tied to the embedding: its one name in a checkpoint (one process's)


def _head_copy_name(model: torch.nn.Module) -> str | None:
    """The name of this rank's copy of a head weight tied to the embedding when the pipeline splits the two (the last
    stage's `lm_head.weight`, `parallel.pipeline.tied_copy`), else None."""
    copy = tied_copy(model) if pp_rank() == pp_size() - 1 else None
    return None if copy is None else next(name for name, p in model.named_parameters() if p is copy)


def _rename_optim_state(optim_sd: dict[str, Any], old: str, new: str) -> None:
    """In place: parameter `old`'s optimizer state (and its entry in the param groups) named `new`."""
    if old in optim_sd["state"]:
        optim_sd["state"][new] = optim_sd["state"].pop(old)
    for group in optim_sd["param_groups"]:
        group["params"] = [new if name == old else name for name in group["params"]]


def _dtype_changes(path: Path, model: torch.nn.Module) -> dict[tuple[torch.dtype, torch.dtype], int]:
    """{(saved dtype, `model`'s dtype): tensor count} for the model tensors the checkpoint at `path` holds in another
    dtype than `model` does. `load` casts them: DCP copies into the model's tensors, and into optimizer state that
    `get_state_dict` creates in each parameter's dtype (as torch's `Optimizer.load_state_dict` casts)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    changes: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
    for name, tensor in model.state_dict().items():
        entry = saved.get(f"model.{name}")  # (None for a tensor not saved, e.g. a LoRA base)
        if hasattr(entry, "properties") and entry.properties.dtype != tensor.dtype:
            changes[entry.properties.dtype, tensor.dtype] += 1
    return dict(changes)


def _note_casts(path: Path, model: torch.nn.Module) -> None:
    """A checkpoint saved under another model.dtype or model.fp32_master_weights loads with its weights and Adam state
    cast to the dtypes this run keeps (bf16 -> fp32 exactly, fp32 -> bf16 rounded), as torch's
    `Optimizer.load_state_dict` and so HF's Trainer do; the main rank says so on stderr, since rounding loses state."""
    if _rank() != 0:
        return
    for (saved, here), count in _dtype_changes(path, model).items():
        how = "upcast exactly" if torch.finfo(here).bits > torch.finfo(saved).bits else "rounded"
        saved_name, here_name = (str(d).removeprefix("torch.") for d in (saved, here))
        print(f"{path}: {count} weights (and their optimizer state) saved in {saved_name} are {how} to {here_name}, "
              f"which this run's model.dtype / model.fp32_master_weights keep them in", file=sys.stderr)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _uses_cuda() -> bool:
    """Whether this process has initialised CUDA. A run on the CPU of a GPU machine never does, and must not start
    now: that costs a context per rank, and a rank forked after its parent initialised CUDA cannot initialise it."""
    return torch.cuda.is_initialized()  # (False without CUDA, and in a child forked from a process that had it)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if _uses_cuda():  # this rank's device only: a resume may see another number of GPUs per process
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and _uses_cuda():  # a GPU run has its model on the device by now
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible device's state
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda)


@contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP without a process group, minus its warning that it assumes one process (one process is a run of its own
    here, not a mistake; the warning broke the progress bar of every single-process run at its first checkpoint)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is (disabled, )?unavailable or uninitialized", UserWarning)
        yield


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory, self.keep = Path(directory), keep

    @classmethod
    def for_run(cls, cfg) -> "CheckpointManager":
        """The checkpoints of the run `cfg` (a `RunConfig`) configures: checkpoint.dir, else
        <trainer.run_dir>/checkpoints."""
        return cls(cfg.checkpoint.dir or Path(cfg.trainer.run_dir) / "checkpoints", cfg.checkpoint.keep)

    def latest(self) -> Path | None:
        pointer = self.directory / "latest"
        if not pointer.is_file():
            return None
        path = self.directory / pointer.read_text().strip()
        return path if (path / "meta.json").is_file() else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             meta: dict[str, Any], trainable_only: bool = False) -> Path:
        """Collective when a process group exists: every rank calls it."""
        final = self.directory / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with _one_process_quiet():
            dcp.save(self._state(model, optimizer, trainable_only), checkpoint_id=str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            world = dist.get_world_size() if dist.is_initialized() else 1
            (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": world, "pp": pp_size()},
                                                      indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer_tmp = self.directory / "latest.tmp"
            pointer_tmp.write_text(final.name)
            os.replace(pointer_tmp, self.directory / "latest")
            self._prune(final)
        _barrier()
        return final

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             trainable_only: bool = False) -> dict[str, Any]:
        """Load into the current layout (DCP reshards); restore this rank's RNG; return meta."""
        meta = json.loads((Path(path) / "meta.json").read_text())
        state = self._state(model, optimizer, trainable_only)
        _check_fits(path, state["model"])  # (every tensor of `state` is in the checkpoint: strict where it matters)
        with _one_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        if optimizer is not None and getattr(model, "ties_head", False):
            # (the param groups saved before the state had one name may be a pipeline's last stage's, which named it so)
            _rename_optim_state(state["optim"], "lm_head.weight", TIED_NAME)
        head = _head_copy_name(model)
        if head is not None and optimizer is not None:  # (the state `_state` named as the embedding's: its own again)
            _rename_optim_state(state["optim"], TIED_NAME, head)
        options = StateDictOptions(strict=not trainable_only, ignore_frozen_params=trainable_only)
        if optimizer is None:
            set_state_dict(model, optimizers=(), model_state_dict=state["model"], optim_state_dict={}, options=options)
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=options)
        _note_casts(Path(path), model)
        rng_file = path / "rng" / f"rank{_rank()}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return meta

    @staticmethod
    def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               trainable_only: bool = False) -> dict[str, Any]:
        """What DCP saves and loads: `get_state_dict`'s model and optimizer entries, under one name at every layout.
        A head tied to the embedding is one parameter in one process, whose optimizer state is the embedding's
        (`TIED_NAME`); a pipeline keeps a copy of it on its first and on its last stage (`parallel.pipeline.tied_copy`),
        which take the same summed gradient and the same steps, so the last stage's copy has the same state and names it
        so too: DCP writes that state once (its two writers' equal tensors, as replicas) and reads it into both copies.
        The weights keep `get_state_dict`'s names (one process's lists the tied weight as the embedding and as
        lm_head: every layout saves both)."""
        options = StateDictOptions(ignore_frozen_params=trainable_only)
        if optimizer is None:
            model_sd, _ = get_state_dict(model, optimizers=(), options=options)
            return {"model": model_sd}
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        head = _head_copy_name(model)
        if head is not None:
            _rename_optim_state(optim_sd, head, TIED_NAME)
        return {"model": model_sd, "optim": optim_sd}

    def _prune(self, saved: Path) -> None:
        """The newest `keep` checkpoints up to `saved` stay. Later ones (an earlier run's, in the same directory) are
        not counted: they outranked `saved`, which was deleted as it was written (and --resume then started over)."""
        done = sorted(p for p in self.directory.glob("step_*") if not p.name.endswith(".tmp") and p.name <= saved.name)
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
