"""The process groups of the parallel layouts the trainer applies, over ranks ordered (dp, pp, cp, tp) with tp innermost
(Megatron's order within a pipeline stage): rank = ((d * pp + p) * cp + c) * tp + t.

- tp groups: tp consecutive ranks (`parallel.tensor`; their DeviceMesh dim, `parallel.fsdp.build_dp_mesh`);
- cp groups: the ranks of one (d, p, t) (`parallel.context`);
- pp groups: the ranks of one (d, c, t), one a pipeline stage (`parallel.pipeline`): each passes its activations to
  the next (and a second group of the same ranks carries the gradients back, so the two kinds never queue behind each
  other on one channel: under an interleaved pipeline two stages pass both ways);
- replica groups: the pp * cp * tp consecutive ranks of one d, which train on the same samples;
- dp groups: the ranks of one (p, c, t), one rank of each replica group, over which host-side sums and object gathers
  run (a sum over every rank would count each sample pp * cp * tp times);
- a stage's ranks: those of one p (d, c and t vary), which hold the same layers: FSDP, expert and tensor parallelism
  run within them (`stage_ranks`).
Without pipeline, context or tensor parallelism (pp = cp = tp = 1) the data-parallel ranks are all ranks."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from moeloop.errors import InputError


@dataclass
class _Groups:
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_group: Any = None  # this rank's pp group (None: pp 1): activations forward, collectives
    pp_grad_group: Any = None  # the same ranks: gradients backward
    vpp: int = 1  # model chunks a pipeline stage holds (interleaved schedule; Megatron's virtual pipeline size)
    pp_ranks: tuple[int, ...] = ()  # the global ranks of this rank's pp group, stage by stage
    ends_group: Any = None  # the first and last stage of this rank's pp group (a tied embedding's two copies)
    first_stage_layers: int = 0  # decoder layers of the first and last stages (0: an even split)
    last_stage_layers: int = 0
    cp_group: Any = None  # this rank's cp group (None: cp 1)
    tp_group: Any = None  # this rank's tp group (None: tp 1)
    replica_group: Any = None  # the pp * cp * tp ranks holding this rank's samples (None: pp * cp * tp = 1)
    dp_group: Any = None  # the ranks with this rank's (p, c, t) (None: every rank, pp * cp * tp = 1)
    timeout: Optional[timedelta] = None  # of every group made here and of the meshes' (None: torch's default)
    sequence_parallel: bool = False  # the tp ranks split the residual stream by rows (`parallel.tensor.shard_sequence`)


_GROUPS = _Groups()


def init_parallel_groups(cp: int = 1, tp: int = 1, pp: int = 1, first_stage_layers: int = 0,
                         last_stage_layers: int = 0, vpp: int = 1, timeout: Optional[timedelta] = None,
                         sequence_parallel: bool = False) -> None:
    """Make the cp, tp, pp, replica and dp groups of the current process group (collective: every rank calls it, with
    the same sizes, once a run: groups made for an earlier process group would be stale); cp = tp = pp = 1 resets
    them. `first_stage_layers` / `last_stage_layers`: an uneven pipeline split (`pipeline_layout`). `vpp`: model
    chunks a stage holds (the interleaved schedule, `parallel.pipeline`). `timeout`: the groups' and the meshes'
    (`group_timeout`), the run's (torch's own default for a subgroup is 30 minutes, whatever the default group's).
    `sequence_parallel`: `parallel.sequence_parallel` (a no-op at tp 1)."""
    check_sequence_parallel(sequence_parallel, cp, pp)
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, size in (("cp", cp), ("tp", tp), ("pp", pp)):
        if size < 1 or world % size:
            raise InputError(f"parallel.{name}={size} must be >= 1 and divide the {world} ranks")
    if world % (pp * cp * tp):
        raise InputError(f"parallel.pp * parallel.cp * parallel.tp = {pp} * {cp} * {tp} must divide the {world} ranks")
    if vpp < 1 or (vpp > 1 and pp == 1):
        raise InputError(f"parallel.vpp={vpp}: the model chunks of a pipeline stage need vpp >= 1, and pp > 1 for "
                         f"vpp > 1 (parallel.pp={pp})")
    _GROUPS.cp, _GROUPS.tp, _GROUPS.pp, _GROUPS.vpp, _GROUPS.timeout = 1, 1, 1, vpp, timeout
    _GROUPS.sequence_parallel = sequence_parallel and tp > 1
    _GROUPS.cp_group = _GROUPS.tp_group = _GROUPS.pp_group = _GROUPS.replica_group = _GROUPS.dp_group = None
    _GROUPS.pp_grad_group = None
    _GROUPS.ends_group = None
    _GROUPS.pp_ranks = ()
    _GROUPS.first_stage_layers, _GROUPS.last_stage_layers = first_stage_layers, last_stage_layers
    if pp * cp * tp == 1:
        return
    rank, block, replica = dist.get_rank(), cp * tp, pp * cp * tp
    mine = {}
    # every rank makes every group, in the same order (new_group is collective)
    for start in range(0, world, block):  # one (d, p): its cp * tp ranks
        for t in range(tp):
            ranks = list(range(start + t, start + block, tp))
            group = dist.new_group(ranks, timeout=_GROUPS.timeout) if cp > 1 else None
            if rank in ranks:
                mine["cp"] = group
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)), timeout=_GROUPS.timeout) if tp > 1 else None
        if start <= rank < start + tp:
            mine["tp"] = group
    for start in range(0, world, replica):
        for offset in range(block):  # one (d, c, t): a rank of each stage
            ranks = [start + p * block + offset for p in range(pp)]
            group = dist.new_group(ranks, timeout=_GROUPS.timeout) if pp > 1 else None
            grads = dist.new_group(ranks, timeout=_GROUPS.timeout) if pp > 1 else None
            ends = dist.new_group([ranks[0], ranks[-1]], timeout=_GROUPS.timeout) if pp > 1 else None
            if rank in ranks:
                mine["pp"], mine["pp_grad"], mine["pp_ranks"], mine["ends"] = group, grads, tuple(ranks), ends
    for start in range(0, world, replica):
        group = dist.new_group(list(range(start, start + replica)), timeout=_GROUPS.timeout)
        if start <= rank < start + replica:
            mine["replica"] = group
    for offset in range(replica):
        group = dist.new_group(list(range(offset, world, replica)), timeout=_GROUPS.timeout)
        if rank % replica == offset:
            mine["dp"] = group
    _GROUPS.cp, _GROUPS.tp, _GROUPS.pp = cp, tp, pp
    _GROUPS.cp_group, _GROUPS.tp_group = mine["cp"], mine["tp"]
    _GROUPS.pp_group, _GROUPS.pp_grad_group, _GROUPS.pp_ranks = mine["pp"], mine["pp_grad"], mine["pp_ranks"]
    _GROUPS.ends_group = mine["ends"]
    _GROUPS.replica_group, _GROUPS.dp_group = mine["replica"], mine["dp"]


def check_sequence_parallel(sequence_parallel: bool, cp: int, pp: int) -> None:
    """What sequence parallelism does not combine with (yet): the message names the fields."""
    for name, size in (("cp", cp), ("pp", pp)):
        if sequence_parallel and size > 1:
            raise InputError(f"parallel.sequence_parallel=true with parallel.{name}={size} is not supported "
                             f"(set parallel.{name}=1 or parallel.sequence_parallel=false)")


def sequence_parallel() -> bool:
    """Whether the tp ranks split the residual stream by rows (`parallel.sequence_parallel` at tp > 1)."""
    return _GROUPS.sequence_parallel


def cp_size() -> int:
    return _GROUPS.cp


def cp_group():
    return _GROUPS.cp_group


def cp_rank() -> int:
    return (dist.get_rank() // _GROUPS.tp) % _GROUPS.cp if _GROUPS.cp > 1 else 0


def tp_size() -> int:
    return _GROUPS.tp


def tp_group():
    return _GROUPS.tp_group


def pp_size() -> int:
    return _GROUPS.pp


def pp_group():
    return _GROUPS.pp_group


def pp_rank() -> int:
    """This rank's pipeline stage."""
    return (dist.get_rank() // (_GROUPS.cp * _GROUPS.tp)) % _GROUPS.pp if _GROUPS.pp > 1 else 0


def pipeline_ends_group():
    """The process group of the first and the last stage of this rank's pp group (None: pp 1)."""
    return _GROUPS.ends_group


def pp_peer(stage: int) -> int:
    """The global rank of `stage` in this rank's pp group (same d, c, t)."""
    return _GROUPS.pp_ranks[stage] if _GROUPS.pp > 1 else dist.get_rank()


def group_timeout() -> Optional[timedelta]:
    """The timeout of the groups made here and of the meshes (`parallel.fsdp.stage_mesh`); None: torch's default."""
    return _GROUPS.timeout


def vpp_size() -> int:
    """Model chunks a pipeline stage holds (1: not interleaved)."""
    return _GROUPS.vpp


def pp_grad_group():
    """The pp group's ranks again: the gradients go back on it (`parallel.pipeline`)."""
    return _GROUPS.pp_grad_group


def pipeline_layout():
    """The pipeline's shape as a `parallel.layout.Layout` (pp, vpp, first/last stage layers): `moeloop plan`'s, whose
    `chunk_layers` / `stage_chunks` split the layers (an even split unless the first or last stage's count is set)."""
    from moeloop.parallel.layout import Layout  # (layout imports the model config)

    return Layout(pp=_GROUPS.pp, vpp=_GROUPS.vpp, first_stage_layers=_GROUPS.first_stage_layers,
                  last_stage_layers=_GROUPS.last_stage_layers)


def stage_ranks() -> list[list[int]]:
    """The ranks of each pipeline stage, stage by stage, each in (d, c, t) order: what FSDP, expert and tensor
    parallelism split over (every rank, as one stage, without pipeline parallelism)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    block, replica = _GROUPS.cp * _GROUPS.tp, replica_size()
    return [[start + p * block + offset for start in range(0, world, replica) for offset in range(block)]
            for p in range(_GROUPS.pp)]


def replica_size() -> int:
    """Ranks that train on the same samples: pp * cp * tp."""
    return _GROUPS.pp * _GROUPS.cp * _GROUPS.tp


def replica_group():
    """The process group of this rank's replica group (None: cp * tp = 1)."""
    return _GROUPS.replica_group


def dp_size() -> int:
    """Data-parallel ranks: groups of ranks that hold different samples."""
    return (dist.get_world_size() if dist.is_initialized() else 1) // replica_size()


def dp_rank() -> int:
    return (dist.get_rank() if dist.is_initialized() else 0) // replica_size()


def dp_group():
    """The process group of the data-parallel ranks (None: the default group)."""
    return _GROUPS.dp_group
