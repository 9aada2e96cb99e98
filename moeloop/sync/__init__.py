"""Weight sync: named tensor stream -> fingerprinted buckets -> transport -> verified, versioned apply."""
from moeloop.sync.bucket import Bucket, fingerprint, pack_buckets, unpack_bucket
from moeloop.sync.shared import drain_before_step, share_parameters
from moeloop.sync.syncer import SyncReport, WeightSyncer, WeightSyncError, verified_tensors
from moeloop.sync.transport import BroadcastTransport, DiskTransport, InProcessTransport, ProcessTransport, Transport


def build_transport(kind: str, **kwargs) -> Transport:
    """`sync.transport` -> a transport object (cuda_ipc is not built yet: it raises)."""
    if kind == "inprocess":
        return InProcessTransport(kwargs.get("device"))
    if kind == "disk":
        return DiskTransport(kwargs["directory"])
    if kind == "broadcast":
        return BroadcastTransport(kwargs.get("src", 0), kwargs.get("group"), kwargs.get("device", "cpu"))
    raise ValueError(f"sync.transport={kind!r} is not available (use inprocess, disk or broadcast)")


__all__ = ["Bucket", "BroadcastTransport", "DiskTransport", "InProcessTransport", "ProcessTransport", "SyncReport",
           "Transport", "WeightSyncError", "WeightSyncer", "build_transport", "drain_before_step", "fingerprint",
           "pack_buckets", "share_parameters", "unpack_bucket", "verified_tensors"]
