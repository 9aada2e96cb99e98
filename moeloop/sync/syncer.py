"""`WeightSyncer`: the one way trainer weights reach a rollout engine.

    syncer = WeightSyncer(transport, bucket_bytes=64 << 20, verify=True)
    report = syncer.push(actor.named_weights(), engine, version=step + 1)
        # 1. engine.pause(); engine.drain()      -> nothing in flight, nothing admitted
        # 2. stream -> buckets (fingerprinted) -> transport -> verify each bucket
        #    (a transport that moves no bytes gets buckets of views: nothing copied, nothing to verify)
        # 3. engine.update_weights(verified tensors, version)   (raises unless drained)
        # 4. engine.resume()                     -> new samples carry `version`
A bucket that fails verification raises `WeightSyncError` and leaves the engine paused at its old
version: it never generates from a half-updated model. Push again to recover.
A receiver in another process (`update_from_buckets`, rollout.mode=disaggregated) gets the buckets themselves and
verifies them where they arrive (`verified_tensors`), after they crossed the process boundary.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

import torch

from moeloop.sync.bucket import Bucket, fingerprint, pack_buckets, unpack_bucket
from moeloop.sync.transport import Transport


class WeightSyncError(RuntimeError):
    pass


class WeightReceiver(Protocol):
    def pause(self) -> None: ...
    def drain(self) -> None: ...
    def resume(self) -> None: ...
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


@dataclass
class SyncReport:
    version: int
    num_tensors: int = 0
    num_buckets: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    manifest: list[tuple[str, tuple[int, ...], str, int]] = field(default_factory=list)  # name, shape, dtype, bucket

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


def verified_tensors(buckets: Iterable[Bucket], verify: bool,
                     on_bucket: Callable[[Bucket], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of `buckets`, each moved bucket's fingerprint checked first (when `verify`)."""
    for bucket in buckets:
        if verify and bucket.moved and fingerprint(bucket.buffer, bucket.fingerprint_kind) != bucket.fingerprint:
            raise WeightSyncError(f"bucket {bucket.index} ({bucket.metas[0].name} ...) failed its checksum; "
                                  f"engine left paused at its previous version")
        if on_bucket is not None:
            on_bucket(bucket)
        yield from unpack_bucket(bucket)


class WeightSyncer:
    def __init__(self, transport: Transport, bucket_bytes: int = 64 << 20, verify: bool = True):
        self.transport, self.bucket_bytes, self.verify = transport, bucket_bytes, verify

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], receiver: WeightReceiver | None,
             version: int) -> SyncReport:
        """Send the stream; apply it to `receiver` (None on ranks that only feed a collective transport)."""
        start = time.perf_counter()
        report = SyncReport(version)
        stream = iter(named_tensors)
        first = next(stream, None)
        stream = itertools.chain([first] if first is not None else [], stream)
        flat = first is None or self.transport.moves_bytes(first[1].device)
        # a receiver in another process lends the buffers its buckets are packed into (`RemoteEngine.bucket_buffer`)
        lend = getattr(receiver, "bucket_buffer", None)
        buckets = self.transport.transfer(pack_buckets(stream, self.bucket_bytes, flat, lend))
        if receiver is None:
            for bucket in buckets:
                self._record(bucket, report)
        else:
            receiver.pause()
            receiver.drain()
            remote = getattr(receiver, "update_from_buckets", None)  # another process: it verifies on arrival
            if remote is not None:
                remote(self._recorded(buckets, report), version, self.verify)
            else:
                receiver.update_weights(verified_tensors(buckets, self.verify, lambda b: self._record(b, report)),
                                        version)
            receiver.resume()
        report.seconds = time.perf_counter() - start
        return report

    def _recorded(self, buckets: Iterable[Bucket], report: SyncReport) -> Iterator[Bucket]:
        for bucket in buckets:
            self._record(bucket, report)
            yield bucket

    @staticmethod
    def _record(bucket: Bucket, report: SyncReport) -> None:
        report.num_buckets += 1
        report.num_bytes += bucket.num_bytes
        report.num_tensors += len(bucket.metas)
        report.manifest += [(m.name, m.shape, str(m.dtype), bucket.index) for m in bucket.metas]
