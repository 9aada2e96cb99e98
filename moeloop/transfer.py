"""Host-to-device copies that do not wait for the GPU.

A copy from pageable host memory (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`) makes the host wait
until every kernel already queued on the stream has finished: the driver stages it through its own pinned
buffer. In a loop that queues work ahead (the engine's async scheduling, the trainer's next micro-batch) that
wait removes the overlap of host and device work. Staged in pinned memory and copied with non_blocking, the copy
is queued like a kernel; PyTorch's caching host allocator keeps the pinned block until its copy has finished.
"""
from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host.to(device)`, through pinned memory when it goes from the CPU to a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: list, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list (index rows, slots, lengths) as a tensor on `device`, through `upload`."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload_into(dest: torch.Tensor, host: torch.Tensor) -> None:
    """`dest.copy_(host)` from the CPU, through pinned memory when `dest` is on a CUDA device (a graph's static input)."""
    if dest.device.type == "cuda" and host.device.type == "cpu":
        dest.copy_(host.pin_memory(), non_blocking=True)
    else:
        dest.copy_(host)
