"""`RewardPool`: score a batch of samples with bounded concurrency, per-call timeout, retries with
exponential backoff, a circuit breaker, and an explicit fallback policy.

    pool = RewardPool.from_config(cfg.reward)       # once per run; reused every step
    stats = pool.score(samples)                     # sets sample.reward / reward_status / reward_info
    log(stats.metrics())                            # scored, timed_out, errored, retried, fallen_back + rates
    pool.close()

A sample the function raises `UnscorableSample` for (a missing or malformed ground truth) falls back at once.
Fallback after the last retry: `mask` -> status "masked" (out of the loss and of the group
baseline, `Sample.in_loss`), `neutral` -> `neutral_score` with status "fallback", `fail` -> raise.
Sync functions run in a thread (or process) pool created once; async functions on the pool's own
event loop, which lives in a daemon thread for the pool's lifetime. A sync function marked
`runs_inline = True` (cheap, pure, bounded: the `arith` rule) runs on the caller's thread, on a
private loop, when the executor is `thread`: no thread hand-off, and no timeout (it cannot hang). A timed-out sync call cannot
be interrupted: it keeps its concurrency slot until it really returns, so the bound always holds.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from moeloop.errors import UnscorableSample, leave_interrupts_to_the_parent
from moeloop.reward.breaker import CircuitBreaker
from moeloop.reward.registry import RewardFn, as_result, is_async_fn
from moeloop.reward.stats import RewardStats
from moeloop.types import RewardResult, Sample

FALLBACKS = ("mask", "neutral", "fail")


class RewardFailure(RuntimeError):
    """Raised by `score` under fallback policy `fail` when some sample could not be scored."""


class RewardPool:
    def __init__(self, fn: RewardFn, *, concurrency: int = 8, timeout_s: float = 10.0, retries: int = 2,
                 backoff_s: float = 0.1, fallback: str = "mask", neutral_score: float = 0.0,
                 breaker: CircuitBreaker | None = None, executor: str = "thread") -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"reward.fallback={fallback!r} must be one of {'|'.join(FALLBACKS)}")
        if concurrency < 1 or timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"reward: need concurrency>=1, timeout_s>0, retries>=0, backoff_s>=0; got "
                             f"{concurrency}, {timeout_s}, {retries}, {backoff_s}")
        self.fn, self.concurrency, self.timeout_s = fn, concurrency, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.fallback, self.neutral_score = fallback, neutral_score
        self.breaker = breaker or CircuitBreaker(threshold=0)
        self._async_fn = is_async_fn(fn)
        self._inline = not self._async_fn and executor == "thread" and getattr(fn, "runs_inline", False) is True
        self._executor = None if self._async_fn or self._inline else _make_executor(executor, concurrency)
        self._inline_loop = asyncio.new_event_loop() if self._inline else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-pool", daemon=True)
        self._thread.start()
        self._slots = asyncio.Semaphore(concurrency)  # only ever used on self._loop
        self.owned: list[Any] = []  # things closed with the pool (e.g. a service supervisor)

    @classmethod
    def from_config(cls, section: Any) -> "RewardPool":
        """Build from a `RewardSection`; starts the local reward service when `server.serve_fn` is set."""
        from moeloop.reward.factory import build_pool
        return build_pool(section)

    # -- public API ------------------------------------------------------------------------------
    def score(self, samples: list[Sample]) -> RewardStats:
        """Score `samples` in place (blocking); see the module docstring for the fallback rules."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("RewardPool.score called from the pool's own loop; use `await ascore`")
        if self._inline_loop is not None and asyncio._get_running_loop() is None:
            return self._inline_loop.run_until_complete(self._score(samples))  # no hop to the pool's thread
        return asyncio.run_coroutine_threadsafe(self._score(samples), self._loop).result()

    async def ascore(self, samples: list[Sample]) -> RewardStats:
        """`score` for callers on any event loop."""
        future = asyncio.run_coroutine_threadsafe(self._score(samples), self._loop)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        for thing in reversed(self.owned):
            thing.close()
        if self._loop.is_running():
            # scoring an interrupted caller left (a Ctrl-C in `score`) ends here, not as "Task was destroyed but it
            # is pending!" on stderr at exit
            try:
                asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=10)
            except TimeoutError:
                pass  # (a task deaf to its cancellation: the loop stops below all the same)
            closer = getattr(self.fn, "aclose", None)
            if closer is not None:
                asyncio.run_coroutine_threadsafe(closer(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._inline_loop is not None:
            self._inline_loop.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the pool's loop ------------------------------------------------------------------
    async def _score(self, samples: list[Sample]) -> RewardStats:
        stats = RewardStats(num_samples=len(samples))
        start = time.monotonic()
        await asyncio.gather(*(self._score_one(s, stats) for s in samples))
        stats.elapsed_s = time.monotonic() - start
        if self.fallback == "fail" and stats.errors:
            raise RewardFailure(f"{len(stats.errors)}/{len(samples)} samples could not be scored "
                                f"(reward.fallback=fail); first error: {stats.errors[0]}")
        return stats

    async def _score_one(self, sample: Sample, stats: RewardStats) -> None:
        """Attempt `sample` up to 1 + retries times, then fall back. Counts per sample: `errored` / `timed_out` once if
        any attempt raised / timed out (the repeats are in `retried`); the breaker hears of every failed attempt."""
        error, raised, timed = "not attempted", False, False
        for attempt in range(self.retries + 1):
            if attempt:
                stats.retried += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                result = await self._call(sample)
            except _CircuitOpen:
                stats.rejected += 1
                error = "circuit breaker open"
                break
            except asyncio.TimeoutError:
                error, timed = f"timeout after {self.timeout_s}s", True
            except UnscorableSample as err:  # no attempt would score it; not the service's failure
                error, raised = f"{type(err).__name__}: {err}", True
                break
            except Exception as err:  # noqa: BLE001 - any failure of user code is retried, then falls back
                error, raised = f"{type(err).__name__}: {err}", True
            else:
                self.breaker.success()
                sample.reward, sample.reward_status, sample.reward_info = result.score, "scored", result.info
                stats.scored += 1
                stats.errored, stats.timed_out = stats.errored + raised, stats.timed_out + timed
                return
            self.breaker.failure()
        stats.errored, stats.timed_out = stats.errored + raised, stats.timed_out + timed
        self._fall_back(sample, error, stats)

    def _fall_back(self, sample: Sample, error: str, stats: RewardStats) -> None:
        stats.errors.append(error)
        if self.fallback == "fail":
            sample.reward_info = {"error": error}
            return
        stats.fallen_back += 1
        stats.masked += self.fallback == "mask"
        sample.reward = self.neutral_score
        sample.reward_status = "masked" if self.fallback == "mask" else "fallback"
        sample.reward_info = {"fallback": self.fallback, "error": error}

    async def _call(self, sample: Sample) -> RewardResult:
        """One attempt: take a concurrency slot, ask the breaker (now, not before queueing), call."""
        if self._inline:  # one at a time on its loop: the concurrency bound holds trivially
            self._admit()
            return as_result(self.fn(sample))
        if self._async_fn:
            async with self._slots:
                self._admit()
                return as_result(await asyncio.wait_for(self.fn(sample), self.timeout_s))  # type: ignore[arg-type]
        await self._slots.acquire()
        try:
            self._admit()
            future = self._loop.run_in_executor(self._executor, self.fn, sample)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return as_result(await asyncio.wait_for(asyncio.shield(future), self.timeout_s))


    def _admit(self) -> None:
        if not self.breaker.allow():
            raise _CircuitOpen()


class _CircuitOpen(Exception):
    """The breaker refused the call; the sample falls back without further retries."""


async def _cancel_pending() -> None:
    """Cancel every task of the running loop but this one, and wait until they have ended."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _make_executor(kind: str, workers: int) -> Executor:
    if kind == "thread":
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
    if kind == "process":  # CPU-bound rules; the function and samples must pickle
        return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=leave_interrupts_to_the_parent)
    raise ValueError(f"reward.executor={kind!r} must be thread|process")

