"""Rule-based reward functions: `math`, `format` and `arith` (the demo's synthetic task).

Each is a plain function of one `Sample`, returning a `RewardResult` whose info records what was
extracted, so a wrong reward can be debugged from the run's logs.
"""
from __future__ import annotations

import re

from moeloop.errors import UnscorableSample
from moeloop.reward.answer import answers_equal, extract_answer
from moeloop.types import RewardResult, Sample

FORMAT_PATTERN = r"(?s)^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"  # R1-style; override per sample
_INT = re.compile(r"-?\d+")
_ANSWER_TAG = re.compile(r"Answer:\s*(\S*)", re.IGNORECASE)
_WHOLE_INT = re.compile(r"-?\d+")


def math_reward(sample: Sample) -> RewardResult:
    """1.0 when the completion's final answer equals the ground truth (math-verify), else 0.0.

    The ground truth may be a bare answer ("3/4") or a full GSM8K solution ending in "#### 42".
    """
    if sample.ground_truth is None:
        raise UnscorableSample("math reward: sample.ground_truth is None")
    gold = extract_answer(str(sample.ground_truth)) or str(sample.ground_truth)
    pred = extract_answer(sample.answer_text)
    if pred is None:
        return RewardResult(0.0, {"pred": None, "gold": gold, "reason": "no answer"})
    ok = answers_equal(gold, pred)
    return RewardResult(float(ok), {"pred": pred, "gold": gold})


def format_reward(sample: Sample) -> RewardResult:
    """1.0 when the completion matches the regex `sample.metadata["format_pattern"]` (default: R1 tags)."""
    pattern = sample.metadata.get("format_pattern", FORMAT_PATTERN)
    ok = re.search(pattern, sample.answer_text) is not None
    return RewardResult(float(ok), {"pattern": pattern})


def arith_answer(text: str) -> int | None:
    """The demo task's answer: the token after the last "Answer:" when present (None unless it is an
    integer, trailing punctuation ignored, so "Answer: 12.5" is None), else the text's last integer."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        token = tagged[-1].rstrip(".,;:!?")
        return int(token) if _WHOLE_INT.fullmatch(token) else None
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def arith_reward(sample: Sample) -> RewardResult:
    """1.0 when the completion's answer is exactly the integer ground truth (`42` or `"42"`)."""
    try:
        gold = int(str(sample.ground_truth).strip())
    except ValueError:
        raise UnscorableSample(f"arith reward: ground_truth must be an integer, got {sample.ground_truth!r}") from None
    pred = arith_answer(sample.answer_text)
    return RewardResult(float(pred == gold), {"pred": pred, "gold": gold})


arith_reward.runs_inline = True  # two linear-time regexes: the RewardPool calls it without a thread hop
