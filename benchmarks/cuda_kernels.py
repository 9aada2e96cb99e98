"""The CUDA kernels a torch profiler recorded, grouped by name: shared by the profiling benchmarks."""
from __future__ import annotations


def kernel_times(prof) -> dict[str, list[float]]:
    """Kernel name -> device time of each launch (us), heaviest total first."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name.setdefault(e.name, []).append(e.device_time)
    return dict(sorted(by_name.items(), key=lambda kv: -sum(kv[1])))
