"""rollout.mode=disaggregated: the rollout engine in a process of its own, on a device of its own.

Each trainer rank starts one engine process (`RemoteEngine`, a spawned daemon) and talks to it through a pipe.
The proxy answers what the loop asks of a colocated engine — `generate`, `pause`, `drain`, `resume` — so the
rollout worker, the rewards and the weight syncer are the same code. Weights cross as the syncer's buckets
(`sync.ProcessTransport`): torch.multiprocessing puts host buffers in shared memory and sends device buffers as
CUDA IPC handles, and the engine process verifies every bucket's fingerprint on its side before applying it
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
from moeloop.errors import InputError
from moeloop.sync import Bucket, verified_tensors

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
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
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

    def update_from_buckets(self, buckets: Iterable[Bucket], version: int, verify: bool) -> None:
        """Send the buckets (`sync.ProcessTransport`'s) and wait until the engine has verified and applied all of
        them at `version`; raises what the engine raised, e.g. `WeightSyncError`."""
        with self.lock:
            self._send(("update_weights", (version, verify)), "update_weights")
            try:
                for bucket in buckets:
                    self._send(("bucket", bucket), "update_weights")
            finally:  # (after a failure on this side, the engine sees an incomplete set and refuses it)
                self._send(("end", None), "update_weights")
            self._reply("update_weights")
            self.policy_version = version

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

    def _reply(self, method: str) -> Any:
        try:
            while not self.conn.poll(1.0):
                if not self.proc.is_alive():
                    raise RemoteRolloutError(f"the rollout process exited (code {self.proc.exitcode}) during {method}")
            status, value = self.conn.recv()
        except (EOFError, OSError) as err:
            raise RemoteRolloutError(f"the rollout process closed its pipe during {method} ({err!r})") from None
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
    kept: dict[int, torch.Tensor] = {}  # the shared host buffers of the last update, so the next maps none anew
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
    """The buckets of one update as they arrive, on the engine's device (a copy that moved: verified)."""

    def __init__(self, conn, device: torch.device, kept: dict[int, torch.Tensor]):
        self.conn, self.device, self.kept, self.done = conn, device, kept, False

    def __iter__(self) -> Iterator[Bucket]:
        while not self.done:
            kind, bucket = self.conn.recv()
            if kind == "end":
                self.done = True
                return
            if bucket.buffer.device.type == "cpu":
                self.kept[bucket.index] = bucket.buffer
            if bucket.buffer.device != self.device:
                bucket.buffer = bucket.buffer.to(self.device)
            bucket.moved = True  # it crossed the process boundary (shared memory or CUDA IPC)
            yield bucket

    def skip_rest(self) -> None:
        """Read the rest of a refused update, so the next call starts at its own message."""
        for _ in self:
            pass


def _send_error(conn, err: Exception) -> None:
    where = traceback.format_exc()
    try:
        conn.send(("error", (err, where)))
    except Exception:  # an exception that does not pickle
        conn.send(("error", (RemoteRolloutError(f"{type(err).__name__}: {err}"), where)))
