"""The process groups of the parallel layouts the trainer applies, over ranks ordered (dp, cp, tp) with tp innermost
(Megatron's order): rank = (d * cp + c) * tp + t.

- tp groups: tp consecutive ranks (`parallel.tensor`; their DeviceMesh dim, `parallel.fsdp.build_dp_mesh`);
- cp groups: the ranks of one (d, t) (`parallel.context`);
- replica groups: the cp * tp consecutive ranks of one d, which train on the same samples;
- dp groups: the ranks of one (c, t), one rank of each replica group, over which host-side sums and object gathers
  run (a sum over every rank would count each sample cp * tp times).
Without context or tensor parallelism (cp = tp = 1) the data-parallel ranks are all ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from moeloop.errors import InputError


@dataclass
class _Groups:
    cp: int = 1
    tp: int = 1
    cp_group: Any = None  # this rank's cp group (None: cp 1)
    tp_group: Any = None  # this rank's tp group (None: tp 1)
    replica_group: Any = None  # the cp * tp ranks holding this rank's samples (None: cp * tp = 1)
    dp_group: Any = None  # the ranks with this rank's (c, t) (None: every rank, cp * tp = 1)


_GROUPS = _Groups()


def init_parallel_groups(cp: int = 1, tp: int = 1) -> None:
    """Make the cp, replica and dp groups of the current process group (collective: every rank calls it, with the
    same sizes, once a run: groups made for an earlier process group would be stale); cp = tp = 1 resets them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, size in (("cp", cp), ("tp", tp)):
        if size < 1 or world % size:
            raise InputError(f"parallel.{name}={size} must be >= 1 and divide the {world} ranks")
    if world % (cp * tp):
        raise InputError(f"parallel.cp * parallel.tp = {cp} * {tp} must divide the {world} ranks")
    if cp * tp == 1:
        _GROUPS.cp, _GROUPS.tp, _GROUPS.cp_group, _GROUPS.tp_group = 1, 1, None, None
        _GROUPS.replica_group = _GROUPS.dp_group = None
        return
    rank, replica = dist.get_rank(), cp * tp
    mine = {}
    # every rank makes every group, in the same order (new_group is collective)
    for start in range(0, world, replica):
        for t in range(tp):
            ranks = list(range(start + t, start + replica, tp))
            group = dist.new_group(ranks) if cp > 1 else None
            if rank in ranks:
                mine["cp"] = group
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp))) if tp > 1 else None
        if start <= rank < start + tp:
            mine["tp"] = group
    for start in range(0, world, replica):
        group = dist.new_group(list(range(start, start + replica)))
        if start <= rank < start + replica:
            mine["replica"] = group
    for offset in range(replica):
        group = dist.new_group(list(range(offset, world, replica)))
        if rank % replica == offset:
            mine["dp"] = group
    _GROUPS.cp, _GROUPS.tp = cp, tp
    _GROUPS.cp_group, _GROUPS.tp_group = mine["cp"], mine["tp"]
    _GROUPS.replica_group, _GROUPS.dp_group = mine["replica"], mine["dp"]


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


def replica_size() -> int:
    """Ranks that train on the same samples: cp * tp."""
    return _GROUPS.cp * _GROUPS.tp


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
