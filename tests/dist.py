"""Run a function on N gloo ranks forked from the test process (parent imports once; ~1 s per test).

    results = run_ranks(fn, world_size=2, *args)   # fn(rank, world_size, *args) -> picklable
Ranks rendezvous through a file:// store in a temp dir; a rank's exception fails the test with its
traceback. Each rank uses one thread so N ranks share the CI's 2 cores politely.
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
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue: Any,
           hang_s: float) -> None:
    torch.set_num_threads(1)
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


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300) -> list[Any]:
    ctx = mp.get_context(os.environ.get("MOELOOP_TEST_START_METHOD") or ("spawn" if torch.cuda.is_available()
                                                                        else "fork"))
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
