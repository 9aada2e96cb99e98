"""The spread of the device copy bandwidth that `rollout.py` divides by: 20 timed 2 GiB copies (CUDA events), the
old median of 5 (host timer) and `copy_bandwidth_bytes_per_s`, three times in one process.

    python benchmarks/copy_bandwidth_spread.py      # CUDA only
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollout  # noqa: E402


def host_median_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
    """The ceiling as `rollout.py` took it before session 14: the median of 5 host-timed copies."""
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def main() -> None:
    for _ in range(3):
        src = torch.randn((2 << 30) // 4, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        nbytes = 2 * src.numel() * src.element_size()
        ev = [nbytes / rollout.copy_seconds(dst, src, "cuda") / 1e9 for _ in range(20)]
        old = host_median_gbps(dst, src)
        del src, dst
        new = rollout.copy_bandwidth_bytes_per_s("cuda") / 1e9
        print(f"events GB/s: min {min(ev):.0f} median {statistics.median(ev):.0f} max {max(ev):.0f} | "
              f"old median-of-5 {old:.0f} | new fn {new:.0f}")


if __name__ == "__main__":
    main()
