"""Weight sync: buckets round-trip exactly, fingerprints catch corruption, the drain gate holds,
and every transport (in-process, disk, gloo broadcast) delivers the same tensors."""
import pytest
import torch

from moeloop.sync import (BroadcastTransport, DiskTransport, InProcessTransport, WeightSyncer, WeightSyncError,
                          fingerprint, pack_buckets, unpack_bucket)
from tests.dist import run_ranks


def _stream(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(7, 5, generator=g)), ("b.bias", torch.randn(3, generator=g).bfloat16()),
            ("c.big", torch.randn(64, 64, generator=g)), ("d.ids", torch.arange(11))]


class FakeEngine:
    """Records the drain-gate protocol the way the rollout engine enforces it."""

    def __init__(self):
        self.paused = self.drained = False
        self.version, self.weights, self.calls, self.data_ptrs = 0, {}, [], {}

    def pause(self):
        self.paused = True
        self.calls.append("pause")

    def drain(self):
        self.drained = True
        self.calls.append("drain")

    def resume(self):
        self.paused = self.drained = False
        self.calls.append("resume")

    def update_weights(self, named, version):
        if not self.drained:
            raise RuntimeError("update_weights needs a drained engine")
        for name, t in named:
            self.weights[name], self.data_ptrs[name] = t.clone(), t.data_ptr()
        self.version = version
        self.calls.append("update")


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1 << 20])
def test_buckets_roundtrip_exactly(bucket_bytes):
    stream = _stream()
    buckets = list(pack_buckets(stream, bucket_bytes))
    got = [item for b in buckets for item in unpack_bucket(b)]
    assert [n for n, _ in got] == [n for n, _ in stream]
    for (_, want), (_, have) in zip(stream, got):
        assert have.dtype == want.dtype and torch.equal(have, want)
    if bucket_bytes == 1:
        assert len(buckets) == len(stream)  # oversize tensors get a bucket each
    if bucket_bytes == 1 << 20:
        assert len(buckets) == 1


def test_fingerprint_is_order_sensitive_and_catches_a_flipped_bit():
    buf = torch.randint(0, 255, (1001,), dtype=torch.uint8)
    base = fingerprint(buf)
    flipped = buf.clone()
    flipped[500] ^= 1
    swapped = buf.clone()
    swapped[[0, 4]] = buf[[4, 0]]
    assert fingerprint(flipped) != base
    assert buf[0] == buf[4] or fingerprint(swapped) != base
    assert fingerprint(buf.clone()) == base


def test_push_follows_drain_gate_and_bumps_version():
    engine = FakeEngine()
    report = WeightSyncer(InProcessTransport(), bucket_bytes=256).push(_stream(), engine, version=3)
    assert engine.calls == ["pause", "drain", "update", "resume"]
    assert engine.version == 3 and report.num_tensors == 4 and report.num_buckets >= 2
    for name, t in _stream():
        assert torch.equal(engine.weights[name], t)


class CorruptingTransport:
    def moves_bytes(self, device):
        return True

    def transfer(self, buckets):
        for b in buckets:
            if b.index == 1:
                b.buffer[0] ^= 0xFF
            yield b


def test_same_device_push_hands_over_views_without_copy():
    """In process on the trainer's device nothing moves: the receiver reads the sender's own tensors (no
    bucket copy, no fingerprint), still through the drain gate and the version bump."""
    engine, stream = FakeEngine(), _stream()
    report = WeightSyncer(InProcessTransport("cpu"), bucket_bytes=256).push(stream, engine, version=2)
    assert engine.calls == ["pause", "drain", "update", "resume"] and engine.version == 2
    assert report.num_tensors == 4 and report.num_bytes == sum(t.numel() * t.element_size() for _, t in stream)
    for name, t in stream:
        assert engine.data_ptrs[name] == t.data_ptr() and torch.equal(engine.weights[name], t)


def test_corrupt_bucket_leaves_engine_paused_at_old_version():
    engine = FakeEngine()
    with pytest.raises(WeightSyncError, match="bucket 1"):
        WeightSyncer(CorruptingTransport(), bucket_bytes=256).push(_stream(), engine, version=5)
    assert engine.version == 0 and engine.paused and "resume" not in engine.calls


def test_disk_transport_roundtrip(tmp_path):
    engine = FakeEngine()
    WeightSyncer(DiskTransport(tmp_path / "sync"), bucket_bytes=300).push(_stream(), engine, version=1)
    for name, t in _stream():
        assert torch.equal(engine.weights[name], t)
    assert (tmp_path / "sync" / "manifest.json").is_file()


def _broadcast_rank(rank, world_size):
    engine = FakeEngine() if rank != 0 else None
    stream = _stream() if rank == 0 else []
    report = WeightSyncer(BroadcastTransport(src=0), bucket_bytes=300).push(stream, engine, version=7)
    if rank == 0:
        return report.num_tensors
    return {n: t for n, t in engine.weights.items()}, engine.version


@pytest.mark.parametrize("start_method", ["", "spawn"])
def test_broadcast_transport_over_gloo(monkeypatch, start_method):
    """Also with the ranks spawned, as `run_ranks` starts them on a machine with CUDA (on this CPU a fork server forks
    them)."""
    monkeypatch.setenv("MOELOOP_TEST_START_METHOD", start_method)
    results = run_ranks(_broadcast_rank, 3)
    assert results[0] == 4
    for weights, version in results[1:]:
        assert version == 7
        for name, t in _stream():
            assert torch.equal(weights[name], t)


def test_fingerprint_kinds_verify_across_devices():
    buf = torch.randint(0, 255, (1003,), dtype=torch.uint8)
    for kind in ("crc32", "wsum"):
        value = fingerprint(buf, kind)
        flipped = buf.clone()
        flipped[7] ^= 4
        assert fingerprint(buf.clone(), kind) == value and fingerprint(flipped, kind) != value
    if torch.cuda.is_available():  # a GPU-made fingerprint verifies on the host and back
        assert fingerprint(buf.cuda(), "wsum") == fingerprint(buf, "wsum")
        assert fingerprint(buf.cuda(), "crc32") == fingerprint(buf, "crc32")


def _wsum_by_definition(buf: torch.Tensor) -> int:
    """The weighted word sum as defined: int32 word i times (i % 65521) + 1, summed mod 2^64, xor the length."""
    padded = torch.cat([buf, buf.new_zeros((-buf.numel()) % 4)])
    words = padded.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item()) ^ (padded.numel() << 1)


def test_wsum_in_chunks_equals_its_definition():
    """The chunked sum (one cached weight chunk per device) gives the defined value, across a chunk boundary too."""
    from moeloop.sync.bucket import _WEIGHT_CHUNK
    gen = torch.Generator().manual_seed(0)
    for size in (1003, 4 * _WEIGHT_CHUNK + 4 * 37 + 3):
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        assert fingerprint(buf, "wsum") == _wsum_by_definition(buf), size
        if torch.cuda.is_available():
            assert fingerprint(buf.cuda(), "wsum") == _wsum_by_definition(buf), size


def test_buckets_packed_into_lent_buffers_equal_fresh_ones():
    """`pack_buckets(buffer_for=...)` (a receiver's lent buffers, `RemoteEngine.bucket_buffer`): the same bytes,
    metas and fingerprints as buckets in buffers of their own, written into the lent memory, asked for once per
    bucket in order with the bucket's padded size, before the bucket is yielded."""
    from moeloop.sync import fingerprint, pack_buckets
    tensors = [("a", torch.arange(300.0)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.ones(2, 90)),
               ("d", torch.full((5,), 3.0, dtype=torch.bfloat16))]
    ring, asked = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)], []

    def lend(index, num_bytes, device):
        asked.append((index, num_bytes, device.type))
        return ring[index % 2][:num_bytes]

    fresh = list(pack_buckets(tensors, bucket_bytes=760))
    for bucket in pack_buckets(tensors, bucket_bytes=760, buffer_for=lend):
        assert asked[-1][0] == bucket.index  # asked for this bucket's buffer, not the next one's
        same = fresh[bucket.index]
        assert bucket.buffer.data_ptr() == ring[bucket.index % 2].data_ptr()
        assert torch.equal(bucket.buffer, same.buffer) and bucket.metas == same.metas
        assert bucket.fingerprint == same.fingerprint == fingerprint(bucket.buffer, bucket.fingerprint_kind)
    assert [a[0] for a in asked] == list(range(len(fresh))) and len(fresh) == 3
    assert [a[1] for a in asked] == [b.num_bytes for b in fresh] and {a[2] for a in asked} == {"cpu"}
