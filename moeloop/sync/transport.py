"""Transports move buckets from the trainer to a rollout engine's receiver.

- `InProcessTransport`: same process (colocated); hands the bucket over, optionally copying it to
  the engine's device. On the trainer's own device nothing moves: buckets of views, no copy.
- `DiskTransport`: one safetensors file per bucket plus a JSON manifest; the fallback that works
  across anything with a shared filesystem.
- `BroadcastTransport`: torch.distributed broadcast (gloo on CPU, NCCL on GPU) from a source rank
  to every rank of a group.
- `ProcessTransport`: for a rollout engine in a process of its own on this node (rollout.mode=disaggregated):
  buckets packed into buffers the receiver lends (shared memory on the host, CUDA IPC on a GPU), sent by its pipe
  as handles. That process verifies each bucket as it arrives (the syncer's `update_from_buckets` path).
Every transport yields the buckets exactly as sent; verification happens in the receiver.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from moeloop.sync.bucket import Bucket, TensorMeta

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)}


class Transport(Protocol):
    def moves_bytes(self, device: torch.device) -> bool:
        """Whether tensors on `device` leave their memory (then buckets are flat and fingerprinted)."""
        ...

    def transfer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Send the buckets; yield them as the receiver sees them."""
        ...


class InProcessTransport:
    def __init__(self, device: torch.device | str | None = None):
        self.device = device

    def moves_bytes(self, device: torch.device) -> bool:
        return self.device is not None and torch.device(self.device) != device

    def transfer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        for bucket in buckets:
            if bucket.views is not None:
                yield bucket  # same memory: the receiver reads the sender's tensors
                continue
            if self.device is not None and bucket.buffer.device != torch.device(self.device):
                bucket = Bucket(bucket.index, bucket.buffer.to(self.device), bucket.metas, bucket.fingerprint,
                                bucket.fingerprint_kind)
            else:
                bucket.moved = False  # handed over as is: same bytes that were fingerprinted
            yield bucket


def _meta_to_json(bucket: Bucket) -> dict:
    metas = [dict(name=m.name, shape=list(m.shape), dtype=str(m.dtype), offset_bytes=m.offset_bytes,
                  num_bytes=m.num_bytes) for m in bucket.metas]
    return {"index": bucket.index, "fingerprint": bucket.fingerprint, "kind": bucket.fingerprint_kind, "metas": metas}


def _meta_from_json(record: dict, buffer: torch.Tensor) -> Bucket:
    metas = [TensorMeta(m["name"], tuple(m["shape"]), _DTYPES[m["dtype"]], m["offset_bytes"], m["num_bytes"])
             for m in record["metas"]]
    return Bucket(record["index"], buffer, metas, record["fingerprint"], record["kind"])


class DiskTransport:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def moves_bytes(self, device: torch.device) -> bool:
        return True

    def transfer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        self.directory.mkdir(parents=True, exist_ok=True)
        records = []
        for bucket in buckets:
            save_file({"buffer": bucket.buffer.cpu()}, self.directory / f"bucket_{bucket.index:05d}.safetensors")
            records.append(_meta_to_json(bucket))
        (self.directory / "manifest.json").write_text(json.dumps(records))
        yield from self.read(self.directory)

    @staticmethod
    def read(directory: Path) -> Iterator[Bucket]:
        for record in json.loads((directory / "manifest.json").read_text()):
            buffer = load_file(directory / f"bucket_{record['index']:05d}.safetensors")["buffer"]
            yield _meta_from_json(record, buffer)


class BroadcastTransport:
    """Collective: every rank of `group` calls `transfer`; only `src` passes real buckets."""

    def __init__(self, src: int = 0, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"):
        self.src, self.group, self.device = src, group, torch.device(device)

    def moves_bytes(self, device: torch.device) -> bool:
        return True

    def transfer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        is_src = dist.get_rank() == self.src
        source = iter(buckets) if is_src else None
        while True:
            bucket = next(source, None) if is_src else None
            header = [_meta_to_json(bucket) | {"num_bytes": bucket.num_bytes} if bucket is not None else None]
            dist.broadcast_object_list(header, src=self.src, group=self.group)
            if header[0] is None:
                return
            buffer = bucket.buffer.to(self.device) if is_src else torch.empty(
                header[0]["num_bytes"], dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=self.src, group=self.group)
            yield _meta_from_json(header[0], buffer)


# buffers a receiver in another process lends at once (`ProcessTransport`): the sender packs one bucket while the
# receiver copies the one before out of the other
LENT_BUFFERS = 2


class ProcessTransport:
    """Buckets for another process (`loop.remote_rollout.RemoteEngine`, whose pipe carries them). The syncer packs
    them straight into buffers that receiver lends (`bucket_buffer`: `LENT_BUFFERS` in turn, kept from push to
    push, host ones in shared memory), so they go as they are: the pipe passes a handle the other process has mapped
    since the first push, and no byte is copied twice. A fresh shared segment or CUDA IPC mapping for every bucket
    costs more than its copy (BENCHMARKS.md, sessions 20-21)."""

    def moves_bytes(self, device: torch.device) -> bool:
        return True

    def transfer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        yield from buckets  # (the receiving process verifies its copy)
