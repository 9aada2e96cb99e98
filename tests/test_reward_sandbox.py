"""The code sandbox against hostile programs, and the `code` reward on top of it.

Each hostile program must end with the right status within its time limit, and leave the machine
clean: no live process of a sandbox uid, no temp dir, no file outside it.
"""
from __future__ import annotations

import socket
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from moeloop.reward.code_reward import CodeReward, extract_program
from moeloop.reward.sandbox import Sandbox, SandboxLimits
from moeloop.types import Sample

LIMITS = SandboxLimits(cpu_s=1, wall_s=2.5, memory_bytes=256 << 20, file_bytes=1 << 20, max_procs=16,
                       output_bytes=32 << 10)
SLACK_S = 5.0  # generous: the machine is shared; containment, not speed, is what is checked


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def roomy_box() -> Sandbox:
    """LIMITS with a long wall deadline, for programs that must end another way (memory, output, an error): on a
    loaded 2-core machine a 0.15 s allocation loop once ran past 2.5 s and ended as a timeout."""
    return Sandbox(replace(LIMITS, wall_s=15.0))


def sandbox_processes() -> list[str]:
    """Live (non-zombie) processes owned by a sandbox uid."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and 2_000_000 <= proc.stat().st_uid < 3_000_000:
                status = (proc / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(f"{proc.name}: {status.splitlines()[0]}")
        except OSError:
            continue
    return found


def sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("moeloop-sandbox-*")}


def run_hostile(box: Sandbox, source: str, stdin: str = ""):
    before = sandbox_dirs()
    start = time.monotonic()
    res = box.run(source, stdin=stdin)
    assert time.monotonic() - start < box.limits.wall_s + SLACK_S
    assert sandbox_processes() == []
    assert sandbox_dirs() <= before
    return res


HOSTILE = {  # name: (program, expected status)
    "infinite_loop": ("while True:\n    pass\n", "timeout"),
    "sleep_past_timeout": ("import time\ntime.sleep(60)\n", "timeout"),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timeout"),
    "memory_hog": ("x = bytearray(1 << 31)\n", "memory"),
    "memory_creep": ("xs = []\nwhile True:\n    xs.append(bytearray(1 << 20))\n", "memory"),
    "huge_output": ("while True:\n    print('x' * 4096)\n", "output_limit"),
    "syntax_error": ("def f(:\n    return 1\n", "compile_error"),
    "raises": ("raise SystemExit(3)\n", "runtime_error"),
    "daemon_left_behind": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('bye')\n", "ok"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(box: Sandbox, roomy_box: Sandbox, name: str) -> None:
    source, expected = HOSTILE[name]
    res = run_hostile(box if expected == "timeout" else roomy_box, source)
    assert res.status == expected, (res.status, res.exit_code, res.stderr[-500:])
    assert len(res.stdout) <= LIMITS.output_bytes and len(res.stderr) <= LIMITS.output_bytes


def test_network_is_unreachable_even_to_localhost(box: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    src = ("import socket\nfor host in ('127.0.0.1', '1.1.1.1'):\n    try:\n"
           f"        socket.create_connection((host, {port} if host == '127.0.0.1' else 80), timeout=2)\n"
           "        print('CONNECTED', host)\n    except OSError as e:\n        print('blocked', host, e)\n")
    res = run_hostile(box, src)
    assert res.status == "ok" and "CONNECTED" not in res.stdout and res.stdout.count("blocked") == 2
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_environment_secrets_are_not_visible(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MOELOOP_TEST_SECRET", secret)
    src = ("import os\nprint(dict(os.environ))\nfor pid in (os.getppid(), 1):\n    try:\n"
           "        print(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError as e:\n        print('denied', e)\n")
    res = run_hostile(box, src)
    assert res.status == "ok" and secret not in res.stdout and "MOELOOP_TEST_SECRET" not in res.stdout


def test_writes_outside_the_temp_dir_do_not_land(box: Sandbox, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    targets = [tmp_path / f"escape-{tag}", Path(f"/tmp/escape-{tag}"), Path(f"/var/tmp/escape-{tag}"),
               Path(f"/dev/shm/escape-{tag}"), Path.cwd() / f"escape-{tag}"]
    src = "import sys\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x'); print('wrote', {str(t)!r})\n"
        f"except OSError as e:\n    print('refused', e)\n" for t in targets)
    src += "open('big.bin', 'wb').write(b'x' * (4 << 20))\n"  # over RLIMIT_FSIZE, inside its own cwd
    res = run_hostile(box, src)
    assert res.status == "runtime_error" and "File too large" in res.stderr
    assert all(not t.exists() for t in targets)


def test_ok_program_reads_stdin(box: Sandbox) -> None:
    res = run_hostile(box, "a, b = map(int, input().split())\nprint(a + b)\n", stdin="2 3\n")
    assert (res.status, res.stdout, res.network_isolated) == ("ok", "5\n", True)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="sandbox.wall_s"):
        Sandbox(SandboxLimits(wall_s=0))


MAIN = "import sys\nargs = sys.stdin.read().split()\nif args:\n    print(add(*map(int, args)))\n"
ADD = "Here:\n```python\ndef add(a, b):\n    return a + b\n" + MAIN + "```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n" + MAIN + "```"  # right only when b == 0


def test_extract_program_takes_last_fenced_block() -> None:
    assert extract_program("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_program("print(1)") == "print(1)"


@pytest.mark.parametrize("completion,expected", [(ADD, 1.0), (WRONG, 0.5), ("```python\ndef (\n```", 0.0)])
def test_code_reward_fraction_of_tests_passed(completion: str, expected: float) -> None:
    gt = {"tests": [{"input": "2 0\n", "output": "2\n"}, {"input": "2 3", "output": "5"}],
          "asserts": ["assert add(0, 0) == 0", "assert add(-1, 1) == 0"]}
    res = CodeReward(LIMITS)(Sample(prompt_ids=[], response_text=completion, ground_truth=gt))
    assert res.score == expected and res.info["total"] == 4


def test_code_reward_rejects_bad_ground_truth() -> None:
    with pytest.raises(ValueError, match="ground_truth must be a dict"):
        CodeReward(LIMITS)(Sample(prompt_ids=[], response_text="x", ground_truth=[1]))
