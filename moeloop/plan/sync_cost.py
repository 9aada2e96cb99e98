"""Weight-sync cost per transport: bytes of the bf16 weight stream over each transport's bandwidth.

One-way, unoverlapped, at the slowest link the stream crosses: disk (safetensors via shared storage),
pcie (host-staged / offload), cuda_ipc (same node, NVLink), broadcast (NCCL over InfiniBand/RoCE),
inprocess (HBM copy). Bandwidths come from `HardwareSection` and can be overridden there.
"""
from __future__ import annotations

from moeloop.config.schema import HardwareSection

GB = 1e9
TRANSPORTS = ("disk", "pcie", "broadcast", "cuda_ipc", "inprocess")


def transport_gbps(hw: HardwareSection) -> dict[str, float]:
    return {"disk": hw.disk_gbps, "pcie": hw.pcie_gbps, "broadcast": hw.network_gbps,
            "cuda_ipc": hw.nvlink_gbps, "inprocess": hw.hbm_gbps}


def transfer_s(nbytes: float, gbps: float) -> float:
    """Seconds to move `nbytes` at `gbps` GB/s (1 GB = 1e9 bytes)."""
    if gbps <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {gbps}")
    return nbytes / (gbps * GB)


def sync_costs(weight_bytes: float, hw: HardwareSection) -> dict[str, float]:
    """Seconds per sync for every transport."""
    return {name: transfer_s(weight_bytes, gbps) for name, gbps in transport_gbps(hw).items()}


def offload_round_trip_s(nbytes_per_rank: float, pcie_gbps: float) -> float:
    """Colocated switch cost: training state to pinned host memory and back, every rank in parallel."""
    return 2 * transfer_s(nbytes_per_rank, pcie_gbps)
