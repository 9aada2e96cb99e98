"""CUDA timing helpers shared by the profiling benchmarks: the kernels a torch profiler recorded, grouped by name,
a CUDA graph of a function (after warm-up runs), and the GPU time of a captured graph replayed back to back."""
from __future__ import annotations

import torch


def kernel_times(prof) -> dict[str, list[float]]:
    """Kernel name -> device time of each launch (us), heaviest total first."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name.setdefault(e.name, []).append(e.device_time)
    return dict(sorted(by_name.items(), key=lambda kv: -sum(kv[1])))


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay of a captured CUDA graph replayed back to back (its GPU time; no host work between)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def captured(run, warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, its outputs) of `run` captured once, after `warmups` eager runs on a side stream (Triton compiles,
    the allocator's first allocations)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out
