"""Reward throughput: 512 responses against a reward with 200 ms latency, serial vs `RewardPool`.

    .venv/bin/python benchmarks/reward.py [--n 512] [--latency-s 0.2] [--concurrency 8 32 64]

The seed's "512 x 2 s serial = 1024 s" problem, scaled down 10x. Two kinds of reward function:
`sync` (blocking, e.g. a rule or a sandbox; pool threads) and `async` (e.g. an HTTP reward model;
the pool's event loop). Prints one table row per run.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from moeloop.reward.pool import RewardPool
from moeloop.types import RewardResult, Sample


def make_sync(latency_s: float):
    def reward(sample: Sample) -> RewardResult:
        time.sleep(latency_s)
        return RewardResult(1.0)
    return reward


def make_async(latency_s: float):
    async def reward(sample: Sample) -> RewardResult:
        await asyncio.sleep(latency_s)
        return RewardResult(1.0)
    return reward


def batch(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[0], response_text=str(i)) for i in range(n)]


def run_serial(n: int, latency_s: float) -> float:
    fn, samples = make_sync(latency_s), batch(n)
    start = time.perf_counter()
    for s in samples:
        s.reward = fn(s).score
    return time.perf_counter() - start


def run_pool(kind: str, n: int, latency_s: float, concurrency: int) -> tuple[float, int]:
    fn = make_sync(latency_s) if kind == "sync" else make_async(latency_s)
    with RewardPool(fn, concurrency=concurrency, timeout_s=10 * latency_s + 5) as pool:
        pool.score(batch(2))  # warm the threads / loop: the pool is built once per run, not per step
        start = time.perf_counter()
        stats = pool.score(batch(n))
        return time.perf_counter() - start, stats.scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    args = parser.parse_args()
    ideal_serial = args.n * args.latency_s
    print(f"{args.n} responses, reward latency {args.latency_s * 1000:.0f} ms")
    print(f"{'mode':<14}{'concurrency':>12}{'wall_s':>10}{'samples/s':>11}{'speedup':>9}{'ideal_s':>9}")
    serial = run_serial(args.n, args.latency_s)
    print(f"{'serial':<14}{1:>12}{serial:>10.2f}{args.n / serial:>11.1f}{1.0:>9.1f}{ideal_serial:>9.2f}", flush=True)
    for kind in ("sync", "async"):
        for c in args.concurrency:
            wall, scored = run_pool(kind, args.n, args.latency_s, c)
            assert scored == args.n, f"only {scored}/{args.n} scored"
            ideal = -(-args.n // c) * args.latency_s
            print(f"{'pool-' + kind:<14}{c:>12}{wall:>10.2f}{args.n / wall:>11.1f}{serial / wall:>9.1f}{ideal:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
