"""`Sandbox`: run an untrusted Python program in a confined subprocess and classify how it ended.

    box = Sandbox(SandboxLimits(cpu_s=2, wall_s=5))
    res = box.run("print(input()[::-1])", stdin="abc")   # res.status == "ok", res.stdout == "cba\\n"

Layers, outside in: (1) as root, each run gets its own fresh uid/gid (no supplementary groups), so
RLIMIT_NPROC really binds (root ignores it) and the leftovers of a run can be swept with
kill(-1) *as that uid*; (2) a new session/process group killed on the wall-clock deadline;
(3) `jail.py` inside the process: network + mount namespaces, rlimits (see there);
(4) an empty 0700 temp cwd removed afterwards, a scrubbed environment, stdout/stderr caps.
Not root: no uid switch, RLIMIT_NPROC counts all of the user's processes (it is raised by their
current number), and the process-group kill is the only sweep.
"""
from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moeloop.reward.jail import COMPILE_ERROR_EXIT, JAIL_FALLBACK_MARK, MEMORY_ERROR_EXIT

SandboxStatus = Literal["ok", "timeout", "memory", "runtime_error", "compile_error", "output_limit"]
_JAIL_SOURCE = (Path(__file__).parent / "jail.py").read_text()
_UID_BASE, _UID_SPAN = 2_000_000, 1_000_000  # fresh ids nobody else uses (no passwd entry needed)
_SWEEP = "import os\nfor _ in range(1000):\n    try: os.kill(-1, 9)\n    except ProcessLookupError: break\n"


@dataclass
class SandboxLimits:
    cpu_s: int = 5  # RLIMIT_CPU, seconds of CPU time
    wall_s: float = 10.0  # wall-clock deadline; the whole process group (and uid) is killed
    memory_bytes: int = 512 << 20  # RLIMIT_AS
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the program may write
    tmpfs_bytes: int = 16 << 20  # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    max_procs: int = 16  # RLIMIT_NPROC
    output_bytes: int = 64 << 10  # cap on stdout and on stderr, each
    network: bool = False  # True = skip the network/mount namespaces

    def check(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_bytes", "file_bytes", "tmpfs_bytes", "max_procs", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    status: SandboxStatus
    exit_code: int | None  # negative = killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    network_isolated: bool = True  # False = namespaces unavailable, the audit-hook fallback was used


def find_interpreter() -> str:
    """A python3 that an unprivileged uid can execute: this one if world-reachable, else the system's."""
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and _world_reachable(Path(candidate)):
            return candidate
    raise RuntimeError("sandbox: no python3 executable by an unprivileged user; set Sandbox(python=...)")


def _world_reachable(path: Path) -> bool:
    if not path.is_file() or not os.stat(path).st_mode & 0o001:
        return False
    return all(os.stat(parent).st_mode & 0o001 for parent in path.parents)


class _UidLease:
    """Hands out fresh uids, never two at once within this process (random across processes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def acquire(self) -> int:
        with self._lock:
            uid = _UID_BASE + random.randrange(_UID_SPAN)
            while uid in self._taken:
                uid = _UID_BASE + random.randrange(_UID_SPAN)
            self._taken.add(uid)
            return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._taken.discard(uid)


_UIDS = _UidLease()


class Sandbox:
    """Runs one Python program per `run` call; thread-safe, holds no process between runs."""

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.limits.check()
        self.python = python or find_interpreter()
        self.switch_uid = os.geteuid() == 0

    def run(self, source: str, stdin: str = "") -> SandboxResult:
        """Run `source` as `main.py` with `stdin`; never raises for anything the program does."""
        uid = _UIDS.acquire() if self.switch_uid else None
        workdir = Path(tempfile.mkdtemp(prefix="moeloop-sandbox-"))
        try:
            self._prepare(workdir, uid, source, stdin)
            return self._execute(workdir, uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                _UIDS.release(uid)

    def _prepare(self, workdir: Path, uid: int | None, source: str, stdin: str) -> None:
        (workdir / "main.py").write_text(source, encoding="utf-8", errors="replace")
        (workdir / ".stdin").write_text(stdin, encoding="utf-8", errors="replace")
        if uid is not None:
            for path in (workdir, workdir / "main.py", workdir / ".stdin"):
                os.chown(path, uid, uid)

    def _execute(self, workdir: Path, uid: int | None) -> SandboxResult:
        start = time.monotonic()
        with open(workdir / ".stdin", "rb") as stdin:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", _JAIL_SOURCE, json.dumps(self._jail_config())],
                stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                env=_scrubbed_env(), start_new_session=True, close_fds=True,
                **({"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}))
        try:
            out, err, cut = _collect(proc, self.limits, start)
        finally:
            self._sweep(proc, uid)
        code = proc.wait()
        return _classify(code, out, err, cut, time.monotonic() - start)

    def _jail_config(self) -> dict[str, object]:
        lim = self.limits
        nproc = lim.max_procs if self.switch_uid else lim.max_procs + _count_own_processes()
        return {"cpu_s": lim.cpu_s, "memory_bytes": lim.memory_bytes, "file_bytes": lim.file_bytes,
                "tmpfs_bytes": lim.tmpfs_bytes, "max_procs": nproc, "network": lim.network}

    def _sweep(self, proc: subprocess.Popen, uid: int | None) -> None:
        """Kill the process group, then (as root) every process still owned by the run's uid."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            subprocess.run([self.python, "-I", "-S", "-c", _SWEEP], user=uid, group=uid, extra_groups=[],
                           env=_scrubbed_env(), cwd="/", stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            stream.close()


def _scrubbed_env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}


def _count_own_processes() -> int:
    uid = os.getuid()
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid)


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None


def _collect(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, bytes, str]:
    """Read stdout/stderr until both close, the deadline passes or a cap is hit.

    Returns (stdout, stderr, cut) with cut = "" | "timeout" | "output_limit". Once the main process
    has exited, leftover children holding the pipes get a short grace, then the deadline applies.
    """
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in bufs:
        sel.register(stream, selectors.EVENT_READ)
    deadline = start + limits.wall_s
    cut = ""
    exited = False
    while sel.get_map():
        if not exited and proc.poll() is not None:
            exited, deadline = True, min(deadline, time.monotonic() + 0.5)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            cut = "timeout" if proc.poll() is None else ""
            break
        for key, _ in sel.select(timeout=min(remaining, 0.1)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fileobj] += chunk
            if len(bufs[key.fileobj]) > limits.output_bytes:
                cut = "output_limit"
        if cut:
            break
    sel.close()
    return bytes(bufs[proc.stdout][:limits.output_bytes]), bytes(bufs[proc.stderr][:limits.output_bytes]), cut


def _classify(code: int, out: bytes, err: bytes, cut: str, wall_s: float) -> SandboxResult:
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    isolated = JAIL_FALLBACK_MARK not in stderr
    if JAIL_FALLBACK_MARK in stderr:
        stderr = stderr.replace(JAIL_FALLBACK_MARK + "\n", "")
    status = cut or _status_of_exit(code, stderr)
    return SandboxResult(status, code, stdout, stderr, wall_s, isolated)  # type: ignore[arg-type]


def _status_of_exit(code: int, stderr: str) -> SandboxStatus:
    if code == 0:
        return "ok"
    if code == COMPILE_ERROR_EXIT:
        return "compile_error"
    if code == MEMORY_ERROR_EXIT or "MemoryError" in stderr:
        return "memory"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # CPU rlimit: SIGXCPU at soft, SIGKILL at hard
        return "timeout"
    if code == -signal.SIGXFSZ:
        return "output_limit"
    return "runtime_error"

