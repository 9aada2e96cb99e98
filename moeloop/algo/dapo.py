"""DAPO batch shaping: dynamic sampling (drop groups that carry no learning signal), the soft
overlong punishment of responses that run into the length limit, and overlong filtering (truncated
responses take no part in the loss; TRL's `mask_truncated_completions`).

Usage in the loop: `overlong_penalty` and `mask_truncated` after scoring, then `filter_uniform_groups`
and refill with new prompts until the batch is full (at most `algorithm.max_refill_rounds` rounds),
then advantages.
"""
from __future__ import annotations

from collections import defaultdict

from moeloop.types import Sample

OVERLONG_INFO_KEY = "overlong_penalty"


def filter_uniform_groups(samples: list[Sample]) -> list[Sample]:
    """Keep the groups whose in-loss rewards are not all equal (order preserved).

    A group with fewer than two in-loss samples is dropped too: its advantages would all be zero.
    Masked samples of a kept group are kept (they stay out of the loss).
    """
    rewards: dict[int, set[float]] = defaultdict(set)
    for sample in samples:
        if sample.in_loss:
            rewards[sample.group_id].add(sample.reward)
    kept = {gid for gid, values in rewards.items() if len(values) > 1}
    return [s for s in samples if s.group_id in kept]


def overlong_penalty(samples: list[Sample], max_response_length: int, buffer_len: int, factor: float) -> list[Sample]:
    """Add DAPO's soft length penalty to each in-loss sample's reward, in place.

    With L = len(response) and expected = max_response_length - buffer_len, the penalty is
    min(0, -(L - expected) / buffer_len * factor): 0 up to `expected`, falling linearly to -factor
    at `max_response_length`. The penalty applied is recorded in `reward_info["overlong_penalty"]`.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"algorithm.overlong_buffer_len={buffer_len} must be in (0, max_response_length={max_response_length}]")
    expected = max_response_length - buffer_len
    for sample in samples:
        if not sample.in_loss:
            continue
        penalty = min(0.0, -(len(sample.response_ids) - expected) / buffer_len * factor)
        sample.reward += penalty
        sample.reward_info[OVERLONG_INFO_KEY] = penalty
    return samples


def mask_truncated(samples: list[Sample]) -> int:
    """Zero the loss mask of every response cut off by the length limit (finish reason "length"), in place;
    return how many. As in DAPO's overlong filtering, such a sample's reward still enters its group's baseline:
    only its own tokens leave the loss (and the loss denominators, which count loss tokens and sequences that
    have one)."""
    count = 0
    for sample in samples:
        if sample.finish_reason == "length" and sample.response_ids:
            sample.loss_mask = [0] * len(sample.response_ids)
            count += 1
    return count
