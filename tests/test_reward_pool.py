"""RewardPool: concurrency bound, timeout/retry/fallback accounting, mask semantics, breaker, config."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moeloop.config.schema import RewardSection
from moeloop.reward.breaker import CircuitBreaker
from moeloop.reward.pool import RewardFailure, RewardPool
from moeloop.reward.rules import arith_reward
from moeloop.types import RewardResult, Sample


def batch(n: int, **kw: object) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_text=str(i), group_id=i // 4, **kw) for i in range(n)]


class PeakCounter:
    """A reward function that records how many calls run at the same time."""

    def __init__(self, sleep_s: float = 0.02) -> None:
        self.sleep_s, self.now, self.peak, self.calls = sleep_s, 0, 0, 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.calls += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


class SyncPeak(PeakCounter):
    def __call__(self, sample: Sample) -> RewardResult:
        self.enter()
        time.sleep(self.sleep_s)
        self.leave()
        return RewardResult(float(sample.response_text))


class AsyncPeak(PeakCounter):
    async def __call__(self, sample: Sample) -> RewardResult:
        self.enter()
        await asyncio.sleep(self.sleep_s)
        self.leave()
        return RewardResult(float(sample.response_text))


@pytest.mark.parametrize("fn_cls", [SyncPeak, AsyncPeak])
@pytest.mark.parametrize("bound", [1, 3, 8])
def test_concurrency_never_exceeds_bound(fn_cls: type, bound: int) -> None:
    fn = fn_cls()
    with RewardPool(fn, concurrency=bound) as pool:
        samples = batch(24)
        stats = pool.score(samples)
    assert fn.peak <= bound
    assert fn.peak == bound  # and the bound is used (24 calls of 20 ms each overlap)
    assert stats.scored == 24 and fn.calls == 24
    assert [s.reward for s in samples] == [float(i) for i in range(24)]
    assert all(s.reward_status == "scored" for s in samples)


def test_timed_out_sync_calls_keep_their_slot() -> None:
    """A sync call cannot be interrupted: after its timeout it still counts against the bound."""
    fn = SyncPeak(sleep_s=0.3)
    with RewardPool(fn, concurrency=2, timeout_s=0.05, retries=1, backoff_s=0.0) as pool:
        stats = pool.score(batch(4))
    assert fn.peak <= 2
    assert stats.timed_out == 4 and stats.fallen_back == 4  # (samples: each timed out twice)


class Flaky:
    """Fails (raise or hang) the first `fail_times` calls of each sample, then scores 1.0."""

    def __init__(self, mode: str, fail_times: int) -> None:
        self.mode, self.fail_times, self.seen = mode, fail_times, {}

    async def __call__(self, sample: Sample) -> RewardResult:
        n = self.seen[sample.response_text] = self.seen.get(sample.response_text, 0) + 1
        if n <= self.fail_times:
            if self.mode == "raise":
                raise ConnectionError("transient")
            await asyncio.sleep(10)
        return RewardResult(1.0)


# `errored` and `timed_out` count samples (the attempts after the first are in `retried`)
@pytest.mark.parametrize("mode,counter,count", [("raise", "errored", 6), ("hang", "timed_out", 6)])
def test_transient_failures_are_retried_then_scored(mode: str, counter: str, count: int) -> None:
    with RewardPool(Flaky(mode, fail_times=2), retries=2, timeout_s=0.05, backoff_s=0.01) as pool:
        samples = batch(6)
        stats = pool.score(samples)
    assert stats.scored == 6 and stats.retried == 12 and getattr(stats, counter) == count
    assert stats.fallen_back == 0 and all(s.reward == 1.0 and s.in_loss for s in samples)


@pytest.mark.parametrize("mode,counter,count", [("raise", "errored", 4), ("hang", "timed_out", 4)])
def test_mask_fallback_removes_sample_from_loss(mode: str, counter: str, count: int) -> None:
    with RewardPool(Flaky(mode, fail_times=99), retries=2, timeout_s=0.05, backoff_s=0.0, fallback="mask") as pool:
        samples = batch(4)
        stats = pool.score(samples)
    assert getattr(stats, counter) == count and stats.retried == 8
    assert stats.fallen_back == stats.masked == 4 and stats.scored == 0
    assert stats.metrics()["reward/fallen_back_rate"] == 1.0
    assert all(s.reward_status == "masked" and not s.in_loss for s in samples)
    assert all(s.reward_info["fallback"] == "mask" and s.reward_info["error"] for s in samples)


def test_errored_counts_samples_not_attempts() -> None:
    """A sample whose scoring raised counts once in `errored`, however many attempts raised; the attempts after the
    first are in `retried`. So `reward/errored_rate` is a fraction of the samples, at most 1."""
    seen: dict[str, int] = {}

    def fn(sample: Sample) -> RewardResult:
        n = seen[sample.response_text] = seen.get(sample.response_text, 0) + 1
        if sample.response_text in ("0", "1") and n <= 2:  # raises twice, then scores
            raise ConnectionError("transient")
        if sample.response_text == "2":  # raises on every attempt: falls back after the retries
            raise ConnectionError("down")
        return RewardResult(1.0)

    with RewardPool(fn, retries=3, backoff_s=0.0) as pool:
        stats = pool.score(batch(5))  # "3" and "4" score at once
    assert seen == {"0": 3, "1": 3, "2": 4, "3": 1, "4": 1}
    assert stats.errored == 3 and stats.retried == 2 + 2 + 3
    assert stats.scored == 4 and stats.masked == 1
    assert stats.metrics()["reward/errored_rate"] == 3 / 5


def test_inline_rule_runs_on_the_callers_thread_with_retries() -> None:
    """A sync fn marked `runs_inline` (the arith rule) runs on the caller's thread; errors still retry and fall back."""
    threads, seen = set(), {}

    def rule(sample: Sample) -> float:
        threads.add(threading.current_thread().name)
        n = seen[sample.response_text] = seen.get(sample.response_text, 0) + 1
        if sample.response_text == "3" or (sample.response_text == "1" and n == 1):
            raise ValueError("bad")
        return 1.0

    rule.runs_inline = True
    with RewardPool(rule, retries=1, backoff_s=0.0, fallback="mask") as pool:
        assert pool._executor is None
        samples = batch(4)
        stats = pool.score(samples)
    assert threads == {threading.current_thread().name}
    assert stats.scored == 3 and stats.errored == 2 and stats.retried == 2 and stats.masked == 1
    assert [s.in_loss for s in samples] == [True, True, True, False]
    assert arith_reward.runs_inline is True

    async def from_a_running_loop() -> None:  # score() inside async code: on the pool's thread, as before
        assert pool.score(batch(1)).scored == 1

    threads.clear()
    with RewardPool(rule) as pool:
        asyncio.run(from_a_running_loop())
    assert threads == {"reward-pool"}


def test_neutral_fallback_scores_but_keeps_in_loss() -> None:
    fn = Flaky("raise", fail_times=99)
    with RewardPool(fn, retries=1, backoff_s=0.0, fallback="neutral", neutral_score=0.25) as pool:
        samples = batch(3)
        stats = pool.score(samples)
    assert stats.fallen_back == 3 and stats.masked == 0 and stats.errored == 3
    assert all(s.reward == 0.25 and s.reward_status == "fallback" and s.in_loss for s in samples)


def test_fail_fallback_raises_with_the_error() -> None:
    with RewardPool(Flaky("raise", fail_times=99), retries=0, fallback="fail") as pool:
        with pytest.raises(RewardFailure, match="2/2 samples.*ConnectionError: transient"):
            pool.score(batch(2))


def test_partial_failure_rates_and_reuse_across_steps() -> None:
    class OddFails:
        def __call__(self, sample: Sample) -> RewardResult:
            if int(sample.response_text) % 2:
                raise ValueError("odd")
            return RewardResult(1.0)

    with RewardPool(OddFails(), retries=1, backoff_s=0.0, concurrency=4) as pool:
        for _ in range(3):  # the same pool, threads and loop serve every step
            samples = batch(8)
            stats = pool.score(samples)
            m = stats.metrics()
            assert (stats.scored, stats.masked, stats.errored, stats.retried) == (4, 4, 4, 4)
            assert m["reward/scored_rate"] == m["reward/masked_rate"] == m["reward/errored_rate"] == 0.5
            assert [s.in_loss for s in samples] == [True, False] * 4


def test_masked_samples_leave_the_group_baseline() -> None:
    """What the trainer does with `in_loss`: a masked sample counts neither in the loss nor the mean."""
    with RewardPool(lambda s: (_ for _ in ()).throw(ValueError()) if s.response_text == "1" else RewardResult(1.0),
                    retries=0) as pool:
        samples = batch(4)  # one group of 4; sample "1" fails
        pool.score(samples)
    kept = [s.reward for s in samples if s.in_loss]
    assert len(kept) == 3 and sum(kept) / len(kept) == 1.0


def test_an_unscorable_sample_falls_back_at_once_and_leaves_the_breaker_closed() -> None:
    """A missing ground truth (arith raises `UnscorableSample`) gets one attempt, no retry and no backoff, and does not
    count against the circuit breaker; the other samples are scored."""
    samples = batch(6, ground_truth="3")
    samples[1].ground_truth = samples[4].ground_truth = None
    breaker = CircuitBreaker(threshold=2, reset_s=60)
    with RewardPool(arith_reward, retries=3, backoff_s=5.0, breaker=breaker) as pool:
        start = time.monotonic()
        stats = pool.score(samples)
    assert time.monotonic() - start < 2.0  # (a retry would wait 5 s)
    assert stats.errored == 2 and stats.retried == 0 and stats.masked == 2 and stats.scored == 4
    assert [s.reward_status for s in samples] == ["scored", "masked", "scored", "scored", "masked", "scored"]
    assert "UnscorableSample: arith reward: ground_truth must be an integer, got None" in stats.errors[0]
    assert breaker.state == "closed"


def test_open_breaker_rejects_without_calling() -> None:
    fn = Flaky("raise", fail_times=99)
    breaker = CircuitBreaker(threshold=3, reset_s=60)
    with RewardPool(fn, concurrency=1, retries=0, breaker=breaker) as pool:
        stats = pool.score(batch(10))
    assert sum(fn.seen.values()) == 3 and stats.rejected == 7 and stats.masked == 10
    assert breaker.state == "open"


def test_breaker_half_open_probe_closes_on_success() -> None:
    breaker = CircuitBreaker(threshold=1, reset_s=0.05)
    breaker.failure()
    assert not breaker.allow()
    time.sleep(0.06)
    assert breaker.allow() and breaker.state == "half-open" and not breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()


def test_async_api_from_another_loop() -> None:
    async def main() -> int:
        with RewardPool(AsyncPeak(), concurrency=4) as pool:
            stats = await pool.ascore(batch(8))
        return stats.scored
    assert asyncio.run(main()) == 8


def test_from_config_builds_builtin_and_validates() -> None:
    with RewardPool.from_config(RewardSection(fn="arith", concurrency=2)) as pool:
        samples = [Sample(prompt_ids=[], response_text="Answer: 5", ground_truth=5),
                   Sample(prompt_ids=[], response_text="Answer: 4", ground_truth=5)]
        pool.score(samples)
    assert [s.reward for s in samples] == [1.0, 0.0]
    with pytest.raises(ValueError, match="reward.fallback"):
        RewardPool.from_config(RewardSection(fallback="drop"))
    with pytest.raises(ValueError, match="reward.executor"):
        RewardPool.from_config(RewardSection(executor="gpu"))


def test_process_executor_for_cpu_bound_rules() -> None:
    with RewardPool.from_config(RewardSection(fn="math", executor="process", concurrency=2, timeout_s=60)) as pool:
        samples = [Sample(prompt_ids=[], response_text="\\boxed{\\frac{1}{2}}", ground_truth="0.5"),
                   Sample(prompt_ids=[], response_text="#### 7", ground_truth="8")]
        stats = pool.score(samples)
    assert stats.scored == 2 and [s.reward for s in samples] == [1.0, 0.0]


def test_close_ends_the_scoring_an_interrupted_caller_left() -> None:
    """A Ctrl-C in `score` leaves its scoring running on the pool's loop; `close` cancels it (and the loop stops), so
    nothing is left pending for asyncio to report as "Task was destroyed but it is pending!" at exit."""
    pool = RewardPool(SyncPeak(sleep_s=0.5), concurrency=2, timeout_s=30)
    scoring = asyncio.run_coroutine_threadsafe(pool._score(batch(4)), pool._loop)  # (what `score` waits on)
    time.sleep(0.1)
    pool.close()
    assert scoring.cancelled()
    assert not pool._thread.is_alive()
