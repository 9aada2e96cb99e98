"""The reward service: an aiohttp server exposing one reward function over HTTP.

    moeloop reward serve --fn math [--host 127.0.0.1] [--port 8011] [--token T] [--concurrency 16]
    moeloop reward serve --fn reward_model --fn-options '{"path": "/models/rm", "device": "cuda"}'

GET /health -> {"status": "ok", "fn": ..., "pid": ...}; POST /score -> batched scores (see wire.py).
Bound to 127.0.0.1 unless told otherwise; with a token (flag or $MOELOOP_REWARD_TOKEN) every
request needs `Authorization: Bearer <token>`. Prints "listening on http://HOST:PORT" once ready.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import sys
from typing import Any

from aiohttp import web

from moeloop.reward.registry import RewardFn, as_result, get_reward_fn, is_async_fn
from moeloop.reward.wire import result_to_json, sample_from_json
from moeloop.types import RewardResult, Sample


class RewardService:
    """Holds the function and the concurrency bound; `app()` builds the aiohttp application."""

    def __init__(self, fn: RewardFn, name: str, token: str = "", concurrency: int = 16) -> None:
        self.fn, self.name, self.token = fn, name, token
        self._async_fn = is_async_fn(fn)
        self._slots = asyncio.Semaphore(concurrency)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_post("/score", self._score)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        expected = f"Bearer {self.token}"
        if self.token and not hmac.compare_digest(request.headers.get("Authorization", ""), expected):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "fn": self.name, "pid": os.getpid()})

    async def _score(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            samples = [sample_from_json(s) for s in body["samples"]]
        except (ValueError, KeyError, TypeError) as err:
            return web.json_response({"error": f"bad /score request: {err}"}, status=400)
        results = await asyncio.gather(*(self._one(s) for s in samples), return_exceptions=True)
        return web.json_response({"results": [result_to_json(r) for r in results]})

    async def _one(self, sample: Sample) -> RewardResult:
        async with self._slots:
            if self._async_fn:
                return as_result(await self.fn(sample))  # type: ignore[misc]
            return as_result(await asyncio.to_thread(self.fn, sample))


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {port}")
    return port


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moeloop reward")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a reward function over HTTP")
    serve.add_argument("--fn", required=True, help="built-in name or dotted path pkg.module.fn")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8011, help="0 = any free port")
    serve.add_argument("--token", default=os.environ.get("MOELOOP_REWARD_TOKEN", ""))
    serve.add_argument("--concurrency", type=int, default=16)
    serve.add_argument("--fn-options", type=_json_object, default={},
                       help="the function's options as a JSON object (reward.fn_options), e.g. a reward model's path")
    return parser.parse_args(argv)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


async def _serve(args: argparse.Namespace) -> None:
    service = RewardService(get_reward_fn(args.fn, **args.fn_options), args.fn, args.token, args.concurrency)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on http://{args.host}:{port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str]) -> int:
    """Entry point of `moeloop reward ...`; returns an exit code."""
    args = _parse(argv)
    if args.concurrency < 1:
        print("moeloop reward: --concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0
