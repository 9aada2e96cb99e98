"""The process groups of the parallel layouts the trainer applies: context parallel groups of cp consecutive ranks
(`parallel.context`), and the data-parallel ranks across them (one rank of each cp group), over which host-side sums
and object gathers run. Without context parallelism (cp 1) the data-parallel ranks are all ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from moeloop.errors import InputError


@dataclass
class _Groups:
    cp: int = 1
    cp_group: Any = None  # this rank's cp group (None: cp 1)
    dp_group: Any = None  # the ranks with this rank's position in their cp group (None: every rank, cp 1)


_GROUPS = _Groups()


def init_context_parallel(cp: int) -> None:
    """Make the cp and dp groups of the current process group (collective: every rank calls it, with the same cp,
    once a run: groups made for an earlier process group would be stale); cp 1 resets them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cp < 1 or world % cp:
        raise InputError(f"parallel.cp={cp} must be >= 1 and divide the {world} ranks")
    if cp == 1:
        _GROUPS.cp, _GROUPS.cp_group, _GROUPS.dp_group = 1, None, None
        return
    rank = dist.get_rank()
    cp_group = dp_group = None
    for start in range(0, world, cp):  # every rank makes every group (new_group is collective)
        group = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            cp_group = group
    for offset in range(cp):
        group = dist.new_group(list(range(offset, world, cp)))
        if rank % cp == offset:
            dp_group = group
    _GROUPS.cp, _GROUPS.cp_group, _GROUPS.dp_group = cp, cp_group, dp_group


def cp_size() -> int:
    return _GROUPS.cp


def cp_group():
    return _GROUPS.cp_group


def cp_rank() -> int:
    return dist.get_rank() % _GROUPS.cp if _GROUPS.cp > 1 else 0


def dp_size() -> int:
    """Data-parallel ranks: groups of ranks that hold different samples."""
    return (dist.get_world_size() if dist.is_initialized() else 1) // _GROUPS.cp


def dp_rank() -> int:
    return (dist.get_rank() if dist.is_initialized() else 0) // _GROUPS.cp


def dp_group():
    """The process group of the data-parallel ranks (None: the default group)."""
    return _GROUPS.dp_group
