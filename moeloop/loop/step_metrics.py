"""What one RL step's batch says about itself: reward, accuracy, lengths, throughput, staleness."""
from __future__ import annotations

import statistics

from moeloop.types import Sample


def batch_metrics(samples: list[Sample], phase_seconds: dict[str, float], world_size: int = 1) -> dict[str, float]:
    """Per-rank batch statistics; throughput counts all ranks' samples (world_size x this rank's)."""
    if not samples:
        return {}
    rewards = [s.reward for s in samples if s.in_loss]
    lengths = [len(s.response_ids) for s in samples]
    step_s = max(sum(phase_seconds.values()), 1e-9)
    gen_s = max(phase_seconds.get("gen", 0.0), 1e-9)
    num_tokens = sum(s.num_tokens for s in samples)
    versions = [s.policy_version for s in samples]
    return {
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "acc/train": statistics.fmean(r >= 1.0 for r in rewards) if rewards else 0.0,
        "response/len_mean": statistics.fmean(lengths),
        "response/len_max": float(max(lengths)),
        "response/clip_ratio": statistics.fmean(s.finish_reason == "length" for s in samples),
        "throughput/samples_per_s": world_size * len(samples) / step_s,
        "throughput/tokens_per_s": world_size * num_tokens / step_s,
        "throughput/gen_tokens_per_s": world_size * sum(lengths) / gen_s,
        "policy/staleness_max": float(max(versions) - min(versions)),
        "batch/samples": float(len(samples)),
    }
