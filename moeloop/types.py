"""The records that cross subsystem boundaries: one `Sample` per completion, rollout -> reward -> training.

A batch of samples is packed into flat token tensors only inside the trainer; everything before
that works on lists of `Sample`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
RewardStatus = Literal["pending", "scored", "fallback", "masked"]


@dataclass
class Sample:
    """One completion of one prompt, with everything later phases attach to it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = None  # engine's logprob of each sampled token (temperature 1)
    finish_reason: FinishReason = "length"
    group_id: int = 0  # GRPO group = the n samples of one prompt
    policy_version: int = 0
    prompt_text: str = ""
    response_text: str = ""
    ground_truth: Any = None
    data_source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    reward_status: RewardStatus = "pending"
    reward_info: dict[str, Any] = field(default_factory=dict)
    baseline: float | None = None  # ReMax: the reward of the prompt's greedy response (None: it fell back)
    # filled by the trainer / algorithm, per response token
    old_logprobs: list[float] | None = None
    old_entropy: list[float] | None = None  # the old policy's entropy at each response token (actor.top_entropy_quantile)
    ref_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    returns: list[float] | None = None
    values: list[float] | None = None
    loss_mask: list[int] | None = None
    # router replay: int16 [num_tokens - 1, MoE layers, K], the experts that computed each position but the last
    # (the rollout engine's for R3, the old-logprob pass's for R2); None = route afresh
    routed_experts: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def answer_text(self) -> str:
        """The text an answer is read from: a multi-turn sample's last assistant turn (its tool calls and the tools'
        results come before it, so a tool's output is never taken for the answer), else the whole response."""
        return self.metadata.get("final_turn_text", self.response_text)

    @property
    def in_loss(self) -> bool:
        """A masked sample (its reward fell back under the `mask` policy) takes no part in the loss."""
        return self.reward_status != "masked"


@dataclass
class RewardResult:
    """What a reward function returns: a score plus free-form info (extracted answer, test results...)."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)
