"""Answer extraction and equivalence for math-style rewards.

Extraction order (first hit wins): GSM8K `#### 42`, the last `\\boxed{...}`, the last number.
Equivalence goes through `math-verify` (fractions, LaTeX, units, thousands separators), with an
exact-string comparison as the last resort when it cannot parse either side.
"""
from __future__ import annotations

import logging
import re

from math_verify import parse, verify

_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns on every call when its signal-based timeout is off; the pool owns timeouts."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (sign, thousands commas, decimals and a/b fractions kept)."""
    found = _NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution text, or None when it holds no answer at all."""
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    boxed = last_boxed(text)
    if boxed:
        return boxed
    return last_number(text)


def normalize(answer: str) -> str:
    """Canonical string form: no `$`, no thousands commas, no surrounding spaces or final period."""
    out = answer.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    return _THOUSANDS.sub("", out)


def answers_equal(gold: str, pred: str) -> bool:
    """True when `pred` and `gold` denote the same mathematical answer."""
    gold_n, pred_n = normalize(gold), normalize(pred)
    if gold_n == pred_n:
        return True
    # timeouts off: math-verify's are SIGALRM-based (main thread only); the RewardPool bounds each call
    gold_p = parse(f"${gold_n}$", parsing_timeout=None)  # type: ignore[arg-type]
    pred_p = parse(f"${pred_n}$", parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_p or not pred_p:
        return False
    return bool(verify(gold_p, pred_p, timeout_seconds=None))
