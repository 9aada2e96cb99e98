"""What one RL step's batch says about itself — reward, accuracy, lengths, throughput, staleness —
summed over DP ranks so the logged numbers describe the global batch."""
from __future__ import annotations

from itertools import repeat
from typing import Sequence

import torch.distributed as dist

from moeloop.parallel.collectives import global_values
from moeloop.types import Sample


def batch_metrics(samples: list[Sample], phase_seconds: dict[str, float], gen_seconds: float | None = None,
                  reward_names: Sequence[str] = ()) -> dict[str, float]:
    """Collective under DP (every rank calls it). `phase_seconds`: the step's phases, one after another (their sum
    is the step); `gen_seconds`: the generation's time when it ran beside them (async rollout), else phase "gen";
    `reward_names`: the reward.fns components (`component_means`)."""
    in_loss = [s for s in samples if s.in_loss]
    lengths = [len(s.response_ids) for s in samples]
    n, n_loss, reward_sum, correct, len_sum, num_tokens, truncated = global_values([
        len(samples), len(in_loss), sum(s.reward for s in in_loss), sum(s.reward >= 1.0 for s in in_loss),
        sum(lengths), sum(s.num_tokens for s in samples), sum(s.finish_reason == "length" for s in samples)])
    versions = [s.policy_version for s in samples] or [0]
    len_max, staleness = global_values([max(lengths, default=0), max(versions) - min(versions)], dist.ReduceOp.MAX)
    step_s = max(sum(phase_seconds.values()), 1e-9)
    gen_s = max(phase_seconds.get("gen", 0.0) if gen_seconds is None else gen_seconds, 1e-9)
    return {
        "reward/mean": reward_sum / max(n_loss, 1), "acc/train": correct / max(n_loss, 1),
        "response/len_mean": len_sum / max(n, 1), "response/len_max": len_max,
        "response/clip_ratio": truncated / max(n, 1),
        "throughput/samples_per_s": n / step_s, "throughput/tokens_per_s": num_tokens / step_s,
        "throughput/gen_tokens_per_s": len_sum / gen_s, "policy/staleness_max": staleness, "batch/samples": n,
        **component_means(in_loss, reward_names),
    }


def component_means(samples: list[Sample], names: Sequence[str]) -> dict[str, float]:
    """`reward_fn/<name>`: each `reward.fns` component's mean score over the samples it scored (no names: nothing).
    Collective under DP when there are names (every rank has the same: all run the same config)."""
    if not names:
        return {}
    sums = [sum(s.reward_info["components"][n] for s in samples if n in s.reward_info.get("components", {}))
            for n in names]
    counts = [sum(n in s.reward_info.get("components", {}) for s in samples) for n in names]
    totals = global_values(sums + counts)
    return {f"reward_fn/{n}": totals[i] / max(totals[len(names) + i], 1.0) for i, n in enumerate(names)}


def logprob_mismatch(samples: list[Sample]) -> dict[str, float]:
    """|engine logprob - trainer logprob| over response tokens: the training-inference mismatch that
    silently corrupts importance ratios when weight sync or numerics go wrong."""
    diffs = [abs(a - b) for s in samples if s.response_logprobs and s.old_logprobs  # (a tool turn's: not sampled)
             for a, b, m in zip(s.response_logprobs, s.old_logprobs, s.loss_mask or repeat(1)) if m]
    total, count = global_values([sum(diffs), len(diffs)])
    (worst,) = global_values([max(diffs, default=0.0)], dist.ReduceOp.MAX)
    if not count:  # old logprobs not computed (on-policy update): nothing measured, nothing logged
        return {}
    return {"rollout/logprob_diff_mean": total / count, "rollout/logprob_diff_max": worst}


def tool_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn rollouts (`loop.multi_turn`): assistant turns and tool calls per sample, the fraction of calls that
    failed (an error, a timeout, an unknown tool or an unreadable call), and the fraction of response tokens that are
    the tools' (out of the loss). Collective under DP."""
    n, turns, calls, errors, tool_tokens, tokens = global_values([
        len(samples), sum(s.metadata.get("turns", 1) for s in samples), sum(s.metadata.get("tool_calls", 0) for s in samples),
        sum(s.metadata.get("tool_errors", 0) for s in samples),
        sum(s.metadata.get("tool_tokens", 0) for s in samples),
        sum(len(s.response_ids) for s in samples)])
    return {"rollout/turns_mean": turns / max(n, 1), "rollout/tool_calls_per_sample": calls / max(n, 1),
            "rollout/tool_error_rate": errors / max(calls, 1), "rollout/tool_token_frac": tool_tokens / max(tokens, 1)}
