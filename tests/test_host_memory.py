"""The CPU trainer's allocator policy: after `retain_freed_host_memory`, a repeated cycle of large
allocations (a step's gradients) is served from retained memory, without page faults once warm
(Linux/glibc; skipped where there is no mallopt)."""
import resource

import pytest
import torch

from moeloop.train.host_memory import retain_freed_host_memory


def _faults_of_one_cycle() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(48 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]  # above any mmap threshold
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_large_blocks_are_reused_without_page_faults_once_warm():
    if not retain_freed_host_memory():
        pytest.skip("no glibc mallopt here")
    for _ in range(10):  # warm-up: the heap grows until freed blocks coalesce into reusable space
        _faults_of_one_cycle()
    assert _faults_of_one_cycle() < 1000  # unmapped on free, each cycle would fault 36864 pages of 4 KiB
