"""The reward service (aiohttp) and its supervisor: health, auth, batched /score, and recovery
from a killed server in the middle of a batch with every sample scored exactly once."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from moeloop.config.schema import RewardSection, RewardServerSection
from moeloop.reward.pool import RewardPool
from moeloop.reward.service import main as service_main
from moeloop.reward.supervisor import ServiceSupervisor
from moeloop.types import RewardResult, Sample

REPO = Path(__file__).resolve().parents[1]


def counting_reward(sample: Sample) -> RewardResult:
    """Served by the test's reward service: records every *completed* call in $MOELOOP_TEST_CALLS.

    The sample tagged `trigger` announces itself (first time only) half a second after it started, then blocks, so
    the test kills the server while the other in-flight calls are still sleeping, i.e. not yet recorded. (The half
    second lets a call that was recorded just as the trigger started deliver its result: killed between its record
    and its reply, it would be retried and recorded twice, which at-least-once retries allow. It happened once on a
    loaded 2-core machine.)
    """
    calls = Path(os.environ["MOELOOP_TEST_CALLS"])
    trigger = calls.with_suffix(".trigger")
    if sample.metadata.get("trigger") and not trigger.exists():
        time.sleep(0.5)
        trigger.write_text(str(os.getpid()))
        time.sleep(60)
    time.sleep(1.0)
    with open(calls, "a") as f:
        f.write(sample.response_text + "\n")
    return RewardResult(float(sample.response_text), {"pid": os.getpid()})


@pytest.fixture
def service_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("MOELOOP_TEST_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return calls


def test_kill_server_mid_batch_every_sample_scored_once(service_env: Path) -> None:
    section = RewardSection(fn="http", concurrency=4, timeout_s=60, retries=3, backoff_s=0.05,
                            server=RewardServerSection(serve_fn=f"{__name__}.counting_reward", health_interval_s=0.2))
    samples = [Sample(prompt_ids=[], response_text=str(i), metadata={"trigger": i == 5}) for i in range(12)]
    with RewardPool.from_config(section) as pool:
        sup = pool.owned[0]
        first_pid = sup.pid
        future = ThreadPoolExecutor(1).submit(pool.score, samples)  # the RL loop's blocking call
        trigger = service_env.with_suffix(".trigger")
        deadline = time.monotonic() + 60
        while not trigger.exists():
            assert time.monotonic() < deadline, "trigger sample never reached the server"
            time.sleep(0.01)
        os.kill(int(trigger.read_text()), signal.SIGKILL)  # the server dies with calls in flight
        stats = future.result(timeout=120)
        assert sup.restarts == 1 and sup.pid != first_pid
    assert stats.scored == 12 and stats.fallen_back == 0 and stats.retried >= 1 and stats.errored >= 1
    assert [s.reward for s in samples] == [float(i) for i in range(12)]
    recorded = service_env.read_text().split()
    assert sorted(recorded, key=int) == [str(i) for i in range(12)]  # each exactly once


def test_health_auth_and_batched_score(service_env: Path) -> None:
    async def talk(url: str) -> None:
        async with aiohttp.ClientSession() as anon:
            async with anon.get(f"{url}/health") as resp:
                assert resp.status == 401
        auth = {"Authorization": "Bearer t0k"}
        async with aiohttp.ClientSession(headers=auth) as client:
            async with client.get(f"{url}/health") as resp:
                body = await resp.json()
                assert resp.status == 200 and body["status"] == "ok" and body["fn"] == "arith"
            batch = {"samples": [{"response_text": "Answer: 3", "ground_truth": 3},
                                 {"response_text": "Answer: 4", "ground_truth": 3},
                                 {"response_text": "Answer: 4", "ground_truth": "x"}]}
            async with client.post(f"{url}/score", json=batch) as resp:
                results = (await resp.json())["results"]
            assert [r.get("score") for r in results] == [1.0, 0.0, None]
            assert "ground_truth must be an integer" in results[2]["error"]
            async with client.post(f"{url}/score", json={"samples": [{"bogus": 1}]}) as resp:
                assert resp.status == 400 and "unknown sample fields" in (await resp.json())["error"]

    with ServiceSupervisor("arith", token="t0k") as sup:
        assert sup.url.startswith("http://127.0.0.1:")
        asyncio.run(talk(sup.url))


def test_pool_over_http_with_token(service_env: Path) -> None:
    section = RewardSection(fn="http", server=RewardServerSection(serve_fn="arith", token="abc"))
    samples = [Sample(prompt_ids=[], response_text=f"Answer: {i}", ground_truth=2) for i in range(4)]
    with RewardPool.from_config(section) as pool:
        stats = pool.score(samples)
    assert stats.scored == 4 and [s.reward for s in samples] == [0.0, 0.0, 1.0, 0.0]


def test_supervisor_reports_a_service_that_cannot_start(service_env: Path) -> None:
    with pytest.raises(RuntimeError, match="no_such_module_xyz.fn"):
        ServiceSupervisor("no_such_module_xyz.fn", startup_timeout_s=30).start()


def test_cli_rejects_unknown_subcommand() -> None:
    with pytest.raises(SystemExit) as exc:
        service_main(["bogus"])
    assert exc.value.code == 2
