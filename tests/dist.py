"""Run a function on N gloo ranks forked from a fork server (~1 s per test; the server starts once, in a few seconds).

    results = run_ranks(fn, world_size=2, *args)   # fn(rank, world_size, *args) -> picklable
Ranks rendezvous through a file:// store in a temp dir; a rank's exception fails the test with its
traceback. Each rank uses one thread so N ranks share the CI's 2 cores politely.
The ranks are not forks of the test process: by then it has run threads (the async RL loop's rollout thread, reward
pools, the tokenizer's pool), and a fork inherits every lock another thread holds at that moment, held for good
(test_run_ranks.py). A thread `join()` has returned from may still be freeing its C thread-locals, MKL's buffers among
them under MKL's allocator lock: a child forked then spins forever in its first matmul on a new thread (26 of 300 forks
right after such a join, outside the suite). The async loop tests forked right after joining their one-process run's
rollout thread, and their ranks start a rollout thread: the likely cause of their rare hangs until the timeout. The
fork server is a fresh interpreter that runs no threads; `fn` and `args` must pickle.
On a machine with CUDA the ranks are spawned instead (a few seconds more each; MOELOOP_TEST_START_METHOD
overrides): there the parent's first backward starts autograd's device threads, and a forked child's backward
then fails ("Unable to handle autograd's threading in combination with fork-based multiprocessing").
"""
from __future__ import annotations

import faulthandler
import io
import os
import tempfile
import traceback
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue: Any,
           hang_s: float) -> None:
    torch.set_num_threads(1)
    faulthandler.enable()  # a rank that crashes prints its stack too (a forked one had inherited pytest's handler)
    # a rank still running near the parent's timeout prints every thread's stack (to the test's captured stderr), so a
    # hang says where it is
    faulthandler.dump_traceback_later(hang_s, exit=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        dist.barrier()
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory tensors: the rank exits right after
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# what the ranks import, imported once by the fork server: torch, the loops, and the test modules whose functions run
# on ranks (they import pytest and transformers; a test module's import took 2.3 s a rank without them, and 1.2 s a
# test went to importing its own module in each rank); torch._dynamo, which torch's optimizers import on first use
# (1.0 s a rank), and transformers' Auto classes, which it imports on first use (0.7 s a rank)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "transformers", "moeloop.loop.rl", "moeloop.loop.sft",
           "moeloop.model.tokenizer", "transformers.models.auto.tokenization_auto",
           "transformers.models.auto.configuration_auto", "moeloop.reward.factory", "tests.dist"] + sorted(
    f"tests.{path.stem}" for path in Path(__file__).parent.glob("test_*.py") if "run_ranks(" in path.read_text())


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300) -> list[Any]:
    method = os.environ.get("MOELOOP_TEST_START_METHOD") or ("spawn" if torch.cuda.is_available() else "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, queue, max(1.0, timeout_s - 10)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            for _ in procs:
                rank, status, payload = queue.get(timeout=timeout_s)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]
