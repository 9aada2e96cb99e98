"""Balanced partition of a batch across data-parallel ranks by token count.

Sorted greedy (LPT): longest sample first, each to the currently lightest rank (lowest rank on
ties). Deterministic, and the heaviest and lightest ranks differ by at most one sample's length.
"""
from __future__ import annotations

from moeloop.types import Sample


def partition_for_dp(samples: list[Sample], dp_size: int, equal_count: bool = False) -> list[list[int]]:
    """Sample indices per DP rank (ascending within each rank), balanced by `num_tokens`.

    With `equal_count`, every rank also gets exactly len(samples) / dp_size samples (then the
    balance bound no longer holds strictly).
    """
    if dp_size <= 0:
        raise ValueError(f"dp_size={dp_size} must be > 0")
    if len(samples) < dp_size:
        raise ValueError(f"{len(samples)} samples cannot give each of dp_size={dp_size} ranks at least one")
    if equal_count and len(samples) % dp_size:
        raise ValueError(f"equal_count: {len(samples)} samples do not divide evenly over dp_size={dp_size}")
    capacity = len(samples) // dp_size if equal_count else len(samples)
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(len(samples)), key=lambda k: (-samples[k].num_tokens, k)):
        rank = min((r for r in range(dp_size) if len(parts[r]) < capacity), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += samples[i].num_tokens
    return [sorted(p) for p in parts]
