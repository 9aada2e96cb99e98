"""rollout.mode=disaggregated: the rollout engine in a process of its own, on a device of its own.

Each trainer rank starts one engine process (`RemoteEngine`, a spawned daemon) and talks to it through a pipe.
The proxy answers what the loop asks of a colocated engine — `generate`, `pause`, `drain`, `resume` — so the
rollout worker, the rewards and the weight syncer are the same code. Weights cross as the syncer's buckets
(`sync.ProcessTransport`), packed into buffers this proxy lends (`RemoteEngine.bucket_buffer`: two in turn, in
shared memory on the host or on the trainer's GPU, mapped by the engine process once and kept). torch.multiprocessing
sends their handles (CUDA IPC for device buffers); the engine process copies each bucket out, acknowledges it so
the trainer may pack the next one into that buffer, and verifies its fingerprint on its side before applying it
(`sync.verified_tensors`), then bumps its policy version. After a bad bucket the engine stays at its old version
and refuses to generate until a push succeeds (as an in-process engine does).

The engine process is spawned, so a script that starts a disaggregated run must do so under
`if __name__ == "__main__":` (Python re-imports the main script in a spawned process; the `moeloop` command does).

Why a process and not a thread (rollout.mode=async): on one GPU, generation beside training only shares the same
HBM and SMs (the H200: 0.72 s a step async against 0.75 s colocated, BENCHMARKS.md session 20), and on a CPU the
two threads share one interpreter lock. A process on its own device or cores has neither.
"""
from __future__ import annotations

import os
import threading
import traceback
from typing import Any, Iterable, Iterator

import torch
import torch.multiprocessing as mp

from moeloop.config import RunConfig
from moeloop.errors import InputError, leave_interrupts_to_the_parent
from moeloop.sync import Bucket, verified_tensors
from moeloop.sync.transport import LENT_BUFFERS

_CALLS = ("generate", "pause", "drain", "resume")


class RemoteRolloutError(RuntimeError):
    """The engine process is gone, or broke the pipe's protocol."""


def rollout_device(cfg: RunConfig, trainer_device: torch.device) -> torch.device:
    """`rollout.device`, or by default: the host for a CPU trainer; on GPUs the device after this node's training
    devices (LOCAL_WORLD_SIZE + LOCAL_RANK), so N training ranks and their N engines take 2N GPUs."""
    if cfg.rollout.device:
        device = torch.device(cfg.rollout.device)
    elif trainer_device.type == "cpu":
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        device = torch.device("cuda", local + int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise InputError(f"rollout.device: {device} for rollout.mode=disaggregated, but {torch.cuda.device_count()} "
                         f"CUDA devices are visible (set rollout.device, or give each training rank a second GPU)")
    return device


def rollout_threads(cfg: RunConfig) -> int:
    """`rollout.threads`, or by default the trainer's intra-op threads: half of them when the engine generates
    while the trainer trains (max_staleness >= 1; the trainer keeps the other half, `loop.rl.RolloutAhead`)."""
    threads = torch.get_num_threads()
    return cfg.rollout.threads or (half_threads(threads) if cfg.rollout.max_staleness >= 1 else threads)


def half_threads(threads: int) -> int:
    """Each side's intra-op threads when the trainer and the rollout run at once on one host's cores."""
    return max(1, threads // 2)


class RemoteEngine:
    """The proxy of an `Engine` in its own process. One call at a time (a second thread's call waits); the
    process is a daemon, so it ends with this one, and `close()` ends it first."""

    def __init__(self, cfg: RunConfig, device: torch.device, threads: int):
        ctx = mp.get_context("spawn")  # (fork would copy a process that may hold CUDA and gloo state)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(cfg, str(device), threads, child), daemon=True,
                                name="moeloop-rollout")
        self.proc.start()
        child.close()
        self.lock = threading.Lock()
        self.lent: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, slot) -> the buffer lent for it
        self.acknowledged = 0  # buckets of the update in progress the engine process has released
        with self.lock:
            self.policy_version = self._reply("start")

    def generate(self, prompts: list[list[int]], params: Any) -> list:
        return self._call("generate", prompts, params)

    def pause(self) -> None:
        self._call("pause")

    def drain(self, abort: bool = False) -> list:
        return self._call("drain", abort)

    def resume(self) -> None:
        self._call("resume")

    def bucket_buffer(self, index: int, num_bytes: int, device: torch.device) -> torch.Tensor:
        """Where the syncer packs bucket `index` of the update in progress: the buffer of slot index % LENT_BUFFERS
        on `device` (in shared memory on the host), kept from push to push, so the engine process maps it once.
        Returned once the engine process has released the bucket packed there before (it copied the bytes out,
        or applied them where it read them in place). The packing is complete before the bucket is sent because
        its fingerprint is read on the host (`sync.bucket._make_bucket`): a mapping the engine process already
        holds waits on no CUDA IPC event."""
        if index >= LENT_BUFFERS:
            self._wait_released(index - LENT_BUFFERS)
        key = (device, index % LENT_BUFFERS)
        lent = self.lent.get(key)
        if lent is None or lent.numel() < num_bytes:  # (the first push, or a larger bucket than before)
            lent = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            self.lent[key] = lent.share_memory_() if device.type == "cpu" else lent
        return lent[:num_bytes]

    def update_from_buckets(self, buckets: Iterable[Bucket], version: int, verify: bool) -> None:
        """Send the buckets (packed into `bucket_buffer`s) and wait until the engine has verified and applied all
        of them at `version`; raises what the engine raised, e.g. `WeightSyncError`."""
        with self.lock:
            self.acknowledged = 0
            self._send(("update_weights", (version, verify)), "update_weights")
            try:
                for bucket in buckets:
                    self._send(("bucket", (bucket, bucket.index % LENT_BUFFERS)), "update_weights")
            except BaseException:  # the engine sees an incomplete set and refuses it; this side's error is raised
                self._send(("end", None), "update_weights")
                try:
                    self._reply("update_weights")
                except Exception:
                    pass  # (its refusal of the incomplete set, or a process already gone)
                raise
            self._send(("end", None), "update_weights")
            self._reply("update_weights")
            self.policy_version = version

    def _wait_released(self, index: int) -> None:
        """Read the engine process's acknowledgements up to bucket `index`'s (in order: one per bucket)."""
        while self.acknowledged <= index:
            status, value = self._receive("update_weights")
            if status != "ack" or value != self.acknowledged:
                raise RemoteRolloutError(f"the rollout process answered {status} {value!r} where bucket "
                                         f"{self.acknowledged}'s acknowledgement belongs")
            self.acknowledged += 1

    def close(self) -> None:
        if not self.proc.is_alive():
            return
        with self.lock:
            try:
                self._send(("close", ()), "close")
                self._reply("close")
            except RemoteRolloutError:
                pass  # it ended on its own meanwhile: the join below finds it gone
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()

    def _call(self, method: str, *args: Any) -> Any:
        with self.lock:
            self._send((method, args), method)
            return self._reply(method)

    def _send(self, message: tuple, method: str) -> None:
        try:
            self.conn.send(message)
        except OSError as err:  # (BrokenPipeError among them)
            self.proc.join(timeout=1)
            raise RemoteRolloutError(f"the rollout process is gone (exit code {self.proc.exitcode}) at {method} "
                                     f"({err!r})") from None

    def _receive(self, method: str) -> tuple[str, Any]:
        try:
            while not self.conn.poll(1.0):
                if not self.proc.is_alive():
                    raise RemoteRolloutError(f"the rollout process exited (code {self.proc.exitcode}) during {method}")
            return self.conn.recv()
        except (EOFError, OSError) as err:
            raise RemoteRolloutError(f"the rollout process closed its pipe during {method} ({err!r})") from None

    def _reply(self, method: str) -> Any:
        status, value = self._receive(method)
        while status == "ack":  # (an update's last acknowledgements, which nothing waited for)
            status, value = self._receive(method)
        if status == "error":
            err, where = value
            err.add_note(f"in the rollout process ({method}):\n{where}")
            raise err
        return value


def serve(cfg: RunConfig, device: str, threads: int, conn) -> None:
    """The engine process: build the engine on `device`, then answer calls until "close" or a closed pipe."""
    from moeloop.loop.components import build_engine  # (the parent's module, imported where it runs)
    from moeloop.loop.env import dtype_of, load_tokenizer
    from moeloop.model.hf_io import load_pretrained

    leave_interrupts_to_the_parent()
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        model = load_pretrained(cfg.model.path, dtype=dtype_of(cfg.model.dtype), device=dev)
        engine = build_engine(cfg, model, load_tokenizer(cfg))
    except Exception as err:
        _send_error(conn, err)
        return
    conn.send(("ok", engine.policy_version))
    kept: dict[int, torch.Tensor] = {}  # the trainer's lent buffers by slot, mapped once (`_Arrivals`)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            if method == "update_weights":
                version, verify = args
                arrivals = _Arrivals(conn, dev, kept)
                try:
                    engine.update_weights(verified_tensors(arrivals, verify), version)
                finally:
                    arrivals.skip_rest()
                value = None
            elif method in _CALLS:
                value = getattr(engine, method)(*args)
            else:
                raise RemoteRolloutError(f"unknown call {method!r}")
            conn.send(("ok", value))
        except Exception as err:
            _send_error(conn, err)


class _Arrivals:
    """The buckets of one update as they arrive, on the engine's device (a copy that moved: verified). Each bucket
    is acknowledged once its lent buffer is no longer read: when its bytes are copied to the engine's device, or,
    read in place (the buffer is on that device), when the engine asks for the next bucket (it applied this one)."""

    def __init__(self, conn, device: torch.device, kept: dict[int, torch.Tensor]):
        self.conn, self.device, self.kept, self.done = conn, device, kept, False
        self.in_place: tuple[int, torch.device] | None = None  # a bucket read in place, not yet acknowledged

    def __iter__(self) -> Iterator[Bucket]:
        while not self.done:
            self._release_in_place()
            kind, payload = self.conn.recv()
            if kind == "end":
                self.done = True
                return
            bucket, slot = payload
            self.kept[slot] = bucket.buffer  # its mapping stays, so the next push's handle finds it (no new map)
            if bucket.buffer.device == self.device:
                self.in_place = (bucket.index, bucket.buffer.device)
            else:
                source = bucket.buffer.device
                try:
                    bucket.buffer = bucket.buffer.to(self.device)
                    if source.type == "cuda":  # (a copy between GPUs runs on the source's stream)
                        torch.cuda.current_stream(source).synchronize()
                finally:
                    self.conn.send(("ack", bucket.index))
            bucket.moved = True  # it crossed the process boundary (shared memory or CUDA IPC)
            yield bucket

    def _release_in_place(self) -> None:
        if self.in_place is not None:
            index, device = self.in_place
            self.in_place = None
            if device.type == "cuda":  # the copies into the parameters read it on the stream
                torch.cuda.current_stream(device).synchronize()
            self.conn.send(("ack", index))

    def skip_rest(self) -> None:
        """Read (and release) the rest of a refused update, so the next call starts at its own message."""
        self._release_in_place()
        while not self.done:
            kind, payload = self.conn.recv()
            if kind == "end":
                self.done = True
            else:
                self.conn.send(("ack", payload[0].index))


def _send_error(conn, err: Exception) -> None:
    where = traceback.format_exc()
    try:
        conn.send(("error", (err, where)))
    except Exception:  # an exception that does not pickle
        conn.send(("error", (RemoteRolloutError(f"{type(err).__name__}: {err}"), where)))
