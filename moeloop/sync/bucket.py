"""Pack a named tensor stream into flat byte buckets with a fingerprint each, and unpack them.

A bucket is one contiguous uint8 buffer of at most `bucket_bytes` (a single tensor larger than
that gets a bucket of its own) plus the metadata to cut it back into named tensors; a bucket that
never leaves the process's memory (`flat=False`) holds views of the sender's tensors instead, with
no copy and no fingerprint: there are no moved bytes to verify. The
fingerprint is CRC-32 for host buffers (zlib, GB/s) and a position-weighted word sum computed on the
device for GPU buffers (no host copy); the bucket records which, so either side can verify it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import zlib

import torch

_MOD_WEIGHTS = 65521  # position weights 1..65521 make the sum order-sensitive
_ALIGN_BYTES = 16  # every tensor starts aligned so the byte view can be re-viewed as its dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset_bytes: int
    num_bytes: int


@dataclass
class Bucket:
    index: int
    buffer: torch.Tensor | None  # uint8, flat; None for a bucket of views
    metas: list[TensorMeta] = field(default_factory=list)
    fingerprint: int = 0
    fingerprint_kind: str = "crc32"  # crc32 (host buffers) | wsum (device buffers)
    moved: bool = True  # False: the receiver holds the very buffer that was fingerprinted (nothing to verify)
    views: list[torch.Tensor] | None = None  # the sender's tensors, when not flat

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() if self.buffer is not None else sum(m.num_bytes for m in self.metas)


def fingerprint_kind_for(buffer_u8: torch.Tensor) -> str:
    return "crc32" if buffer_u8.device.type == "cpu" else "wsum"


def fingerprint(buffer_u8: torch.Tensor, kind: str | None = None) -> int:
    """Order-sensitive fingerprint of a flat uint8 buffer; `kind` defaults to the buffer's device's."""
    kind = kind or fingerprint_kind_for(buffer_u8)
    if kind == "crc32":
        return zlib.crc32(buffer_u8.detach().cpu().numpy())
    if kind != "wsum":
        raise ValueError(f"unknown fingerprint kind {kind!r}")
    pad = (-buffer_u8.numel()) % 4
    if pad:
        buffer_u8 = torch.cat([buffer_u8, buffer_u8.new_zeros(pad)])
    words = buffer_u8.view(torch.int32)
    weights = _position_weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), weights.numel()):  # one int32 x int64 product and one sum per chunk
        chunk = words[start: start + weights.numel()]
        total += (chunk * weights[: chunk.numel()]).sum()
    return int(total.item()) ^ (buffer_u8.numel() << 1)


_WEIGHT_CHUNK = _MOD_WEIGHTS * 128  # words per chunk: a whole number of weight periods, so every chunk's are the same
_weights_on: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device) -> torch.Tensor:
    """Word i's weight (i % 65521) + 1, int64, for one chunk (64 MiB), made once per device: the weighted sum takes
    two passes over a bucket's words instead of six."""
    if device not in _weights_on:
        _weights_on[device] = torch.arange(_WEIGHT_CHUNK, dtype=torch.int64, device=device) % _MOD_WEIGHTS + 1
    return _weights_on[device]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, flat: bool = True,
                 buffer_for: Callable[[int, int, torch.device], torch.Tensor] | None = None) -> Iterator[Bucket]:
    """Yield buckets in stream order; each flat one is fingerprinted once, when it is full. `buffer_for(index,
    num_bytes, device)`: where flat bucket `index` is packed (a receiver's lent buffer), instead of a new one."""
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes, index = 0, 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > bucket_bytes:
            yield _make_bucket(index, pending, buffer_for) if flat else _view_bucket(index, pending)
            pending, pending_bytes, index = [], 0, index + 1
        pending.append((name, tensor))
        pending_bytes += size
    if pending:
        yield _make_bucket(index, pending, buffer_for) if flat else _view_bucket(index, pending)


def _view_bucket(index: int, items: list[tuple[str, torch.Tensor]]) -> Bucket:
    views = [tensor.detach() for _, tensor in items]
    metas = [TensorMeta(name, tuple(t.shape), t.dtype, -1, t.numel() * t.element_size()) for (name, _), t in zip(items, views)]
    return Bucket(index, None, metas, fingerprint_kind="none", moved=False, views=views)


def _make_bucket(index: int, items: list[tuple[str, torch.Tensor]],
                 buffer_for: Callable[[int, int, torch.device], torch.Tensor] | None = None) -> Bucket:
    parts, metas, offset = [], [], 0
    for name, tensor in items:
        raw = _as_bytes(tensor)
        metas.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype, offset, raw.numel()))
        pad = (-raw.numel()) % _ALIGN_BYTES
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
        offset += raw.numel() + pad
    if buffer_for is not None:
        buffer = torch.cat(parts, out=buffer_for(index, offset, parts[0].device))
    else:
        buffer = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    kind = fingerprint_kind_for(buffer)
    return Bucket(index, buffer, metas, fingerprint(buffer, kind), kind)


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into the bucket's buffer (or the sender's tensors), one per tensor (no copy)."""
    if bucket.views is not None:
        yield from ((meta.name, view) for meta, view in zip(bucket.metas, bucket.views))
        return
    for meta in bucket.metas:
        raw = bucket.buffer[meta.offset_bytes: meta.offset_bytes + meta.num_bytes]
        yield meta.name, raw.view(meta.dtype).view(meta.shape)
