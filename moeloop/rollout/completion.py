"""`Completion`: what the engine returns for one finished sample, and its conversion to `Sample`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeloop.types import FinishReason, Sample


@dataclass
class Completion:
    """One finished sample.

    `logprobs[i]` is log_softmax(raw model logits)[response_ids[i]] computed in fp32 from the logits
    the engine sampled from: temperature 1, no top-k/top-p filtering — the policy's own distribution,
    which is what RL importance ratios need. It is None when SamplingParams.logprobs is False.
    `policy_version` is the engine's weight version for every token: a drain-with-abort re-queues a
    sample from its prompt, so no completion mixes two versions.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    policy_version: int
    text: str | None = None
    num_preemptions: int = 0
    metadata: dict = field(default_factory=dict)
    # rollout.record_routes: int16 [len(prompt_ids) + len(response_ids) - 1, MoE layers, K], the experts that
    # computed each position the engine ran (every one but the last token's); None otherwise
    routed_experts: Any = None


def completions_to_samples(completions: list[Completion], group_ids: dict[str, int] | None = None) -> list[Sample]:
    """One `Sample` per completion; samples of one request share a group id (request order if not given)."""
    if group_ids is None:
        group_ids = {}
        for c in completions:
            group_ids.setdefault(c.request_id, len(group_ids))
    return [Sample(prompt_ids=list(c.prompt_ids), response_ids=list(c.response_ids),
                   response_logprobs=None if c.logprobs is None else list(c.logprobs),
                   finish_reason=c.finish_reason, group_id=group_ids[c.request_id],
                   policy_version=c.policy_version, response_text=c.text or "", routed_experts=c.routed_experts,
                   metadata={"request_id": c.request_id, "sample_index": c.sample_index})
            for c in completions]
