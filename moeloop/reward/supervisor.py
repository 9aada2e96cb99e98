"""`ServiceSupervisor`: start `moeloop reward serve`, health-check it, restart it when it dies.

    with ServiceSupervisor("math") as sup:          # blocks until /health answers
        fn = RemoteReward(supervisor=sup)            # follows sup.url; waits out restarts
    # closed: the service process is terminated

A monitor thread polls the process and /health every `health_interval_s`; a dead process or
`unhealthy_after` failed checks in a row trigger a restart on the same port, at most
`max_restarts` times (then `failed` is set and waiters give up).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

_READY_PREFIX = "listening on "


class ServiceSupervisor:
    def __init__(self, fn: str, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 health_interval_s: float = 0.5, startup_timeout_s: float = 60.0, max_restarts: int = 5,
                 unhealthy_after: int = 3, concurrency: int = 16, fn_options: dict | None = None) -> None:
        """`fn_options`: the served function's options (`moeloop reward serve --fn-options`)."""
        self.fn, self.host, self.port, self.token = fn, host, port, token
        self.fn_options = dict(fn_options or {})
        self.health_interval_s, self.startup_timeout_s = health_interval_s, startup_timeout_s
        self.max_restarts, self.unhealthy_after, self.concurrency = max_restarts, unhealthy_after, concurrency
        self.restarts = 0
        self.failed = False
        self.proc: subprocess.Popen | None = None
        self._healthy = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "ServiceSupervisor":
        self._launch()
        self._monitor = threading.Thread(target=self._watch, name="reward-supervisor", daemon=True)
        self._monitor.start()
        return self

    def wait_healthy(self, timeout_s: float) -> bool:
        """Block until the service answers /health (asking the monitor to look now); False on timeout."""
        if self._healthy.is_set() and self.check_health():
            return True
        self._healthy.clear()
        self._wake.set()
        return self._healthy.wait(timeout_s) and not self.failed

    def check_health(self) -> bool:
        req = urllib.request.Request(f"{self.url}/health", headers=self._auth_headers())
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return resp.status == 200 and json.load(resp).get("status") == "ok"
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
        self._terminate()

    def __enter__(self) -> "ServiceSupervisor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _launch(self) -> None:
        cmd = [sys.executable, "-m", "moeloop", "reward", "serve", "--fn", self.fn, "--host", self.host,
               "--port", str(self.port), "--concurrency", str(self.concurrency)]
        if self.fn_options:
            cmd += ["--fn-options", json.dumps(self.fn_options)]
        env = {**os.environ, "MOELOOP_REWARD_TOKEN": self.token}
        with self._lock:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env,
                                         start_new_session=True)
        self.port = self._read_port(self.proc)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.check_health():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self._terminate()
                raise RuntimeError(f"reward service --fn {self.fn} not healthy at {self.url} "
                                   f"within reward.server.startup_timeout_s={self.startup_timeout_s}")
            time.sleep(0.05)
        self._healthy.set()

    def _read_port(self, proc: subprocess.Popen) -> int:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the service prints its address once bound
        if not line.startswith(_READY_PREFIX):
            self._terminate()
            raise RuntimeError(f"reward service --fn {self.fn} exited before listening (exit {proc.wait()})")
        return int(line.strip().rsplit(":", 1)[1])

    def _watch(self) -> None:
        misses = 0
        while not self._stop.is_set():
            self._wake.wait(self.health_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            alive = self.proc is not None and self.proc.poll() is None
            misses = 0 if alive and self.check_health() else misses + 1
            if alive and misses and misses < self.unhealthy_after:
                continue
            if misses:
                self._restart()
                misses = 0

    def _restart(self) -> None:
        self._healthy.clear()
        if self.restarts >= self.max_restarts:
            self.failed = True
            self._healthy.set()  # release waiters; they see `failed`
            return
        self._terminate()
        self.restarts += 1
        try:
            self._launch()
        except RuntimeError:
            pass  # the next round of the monitor tries again (and counts it)

    def _terminate(self) -> None:
        with self._lock:
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
