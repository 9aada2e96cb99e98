"""`http` reward: ask a remote reward service (`moeloop reward serve`, a judge, a reward model).

Posts each sample as a one-item batch to `{url}/score` with an optional bearer token. Connection
failures raise so the pool retries; when a local `ServiceSupervisor` is attached, the failing call
first waits (within the pool's timeout) until the supervisor has the service healthy again.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp

from moeloop.reward.wire import result_from_json, sample_to_json
from moeloop.types import RewardResult, Sample


class RemoteReward:
    def __init__(self, url: str = "", token: str = "", supervisor: Any = None, recover_wait_s: float = 60.0) -> None:
        if not url and supervisor is None:
            raise ValueError("reward.server.url must be set for reward.fn=http")
        self._url = url.rstrip("/")
        self.token = token or os.environ.get("MOELOOP_REWARD_TOKEN", "")
        self.supervisor = supervisor
        self.recover_wait_s = recover_wait_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return self.supervisor.url if self.supervisor is not None else self._url

    async def __call__(self, sample: Sample) -> RewardResult:
        payload = {"samples": [sample_to_json(sample)]}
        try:
            async with self._client().post(f"{self.url}/score", json=payload) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"reward service {self.url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                body = await resp.json()
        except aiohttp.ClientConnectionError:
            await self._await_recovery()
            raise
        return result_from_json(body["results"][0])

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _await_recovery(self) -> None:
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.wait_healthy, self.recover_wait_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
