"""`code` reward: run the completion's program against test cases in the `Sandbox`.

Ground truth, either form:
    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}    stdin -> expected stdout (whitespace-trimmed)
    {"asserts": ["assert add(1, 2) == 3", ...]}               each appended to the program, run alone
Score = fraction of cases passed. The program is the last ```python fenced block, else the whole text.
"""
from __future__ import annotations

import re
from typing import Any

from moeloop.errors import UnscorableSample
from moeloop.reward.sandbox import Sandbox, SandboxLimits, SandboxResult
from moeloop.types import RewardResult, Sample

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str:
    """The last fenced code block of a completion, or the completion itself when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _cases(ground_truth: Any) -> list[tuple[str, str, str | None]]:
    """(program suffix, stdin, expected stdout or None) per test case."""
    if not isinstance(ground_truth, dict) or not ({"tests", "asserts"} & ground_truth.keys()):
        raise UnscorableSample(f"code reward: ground_truth must be a dict with 'tests' or 'asserts', got {ground_truth!r:.200}")
    cases = [("", str(t["input"]), str(t["output"])) for t in ground_truth.get("tests", [])]
    cases += [("\n\n" + str(a) + "\n", "", None) for a in ground_truth.get("asserts", [])]
    if not cases:
        raise UnscorableSample("code reward: ground_truth has no test cases")
    return cases


def _passed(res: SandboxResult, expected: str | None) -> bool:
    if res.status != "ok":
        return False
    return expected is None or res.stdout.strip() == expected.strip()


class CodeReward:
    """Callable reward; one `Sandbox` (stateless, thread-safe) shared by all calls."""

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.sandbox = Sandbox(limits or SandboxLimits(cpu_s=5, wall_s=10), python=python)

    def __call__(self, sample: Sample) -> RewardResult:
        program = extract_program(sample.answer_text)
        statuses = []
        passed = 0
        for suffix, stdin, expected in _cases(sample.ground_truth):
            res = self.sandbox.run(program + suffix, stdin=stdin)
            statuses.append(res.status)
            passed += _passed(res, expected)
            if res.status == "compile_error":  # the same program fails to compile for every case
                break
        total = len(_cases(sample.ground_truth))
        return RewardResult(passed / total, {"passed": passed, "total": total, "statuses": statuses})
