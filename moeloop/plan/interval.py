"""Checkpoint interval by Young/Daly: save every sqrt(2 * C * MTBF) seconds, C = cost of one save."""
from __future__ import annotations

import math


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum; valid while save_s << mtbf_s."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_s >= 0 and mtbf_s > 0, got {save_s}, {mtbf_s}")
    return math.sqrt(2.0 * save_s * mtbf_s)


def save_every_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    """The interval in whole steps (at least 1)."""
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / step_s))


def expected_overhead(save_s: float, mtbf_s: float) -> float:
    """Fraction of wall time lost to saving plus expected rework at the optimum: about sqrt(2C/MTBF)."""
    return math.sqrt(2.0 * save_s / mtbf_s)
