"""tests/dist.py starts its ranks clean: a lock that another thread of the test process holds when they start is free
in them. A fork of the test process inherits it held for good (as a fork right after a thread that ran matmuls was
joined can inherit MKL's allocator lock, and spin in its first matmul on a new thread: tests/dist.py)."""
import threading

from tests.dist import run_ranks

HELD = threading.Lock()  # (a clean rank imports this module afresh: a lock of its own)


def _takes_the_lock(rank, world_size):
    return HELD.acquire(timeout=5)


def test_a_lock_held_by_another_thread_of_the_test_process_is_free_in_the_ranks():
    holding, done = threading.Event(), threading.Event()

    def hold():
        with HELD:
            holding.set()
            done.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    try:
        assert run_ranks(_takes_the_lock, 2) == [True, True]
    finally:
        done.set()
        holder.join()
