"""`Sequence`: one sample being generated — its tokens, KV block table, progress and status.

A request with n samples becomes n sequences. Sample 0 is the group leader; samples 1..n-1 fork from it
in the step its prompt K/V is computed (shared full blocks, a copy of the partial one; see the scheduler). One that
cannot fork waits for the leader and reuses its full prompt blocks through the prefix cache (with none to share,
it prefills on its own).

Pending tokens (async scheduling): a token sampled by a step that is still running on the device is
counted in `len(seq)` and `num_response_tokens` (so the next step can be scheduled) but is not yet in
`token_ids`; `append` fills the oldest pending token once the step's output reaches the host.
"""
from __future__ import annotations

import enum
import itertools

from moeloop.rollout.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("seq_id", "request_id", "sample_index", "params", "seed", "leader", "num_prompt_tokens", "token_ids",
                 "logprobs", "status", "block_table", "num_computed_tokens", "num_hashed_blocks", "finish_reason",
                 "policy_version", "num_preemptions", "num_pending")  # read per sequence per decode step

    def __init__(self, request_id: str, sample_index: int, prompt_ids: list[int], params: SamplingParams,
                 seed: int, leader: "Sequence | None" = None):
        self.seq_id = next(_ids)
        self.request_id, self.sample_index = request_id, sample_index
        self.params, self.seed, self.leader = params, seed, leader
        self.num_prompt_tokens = len(prompt_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.logprobs: list[float] = []
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.finish_reason: str | None = None
        self.policy_version = -1  # set when the first response token is sampled
        self.num_preemptions = 0
        self.num_pending = 0  # sampled on the device, not yet on the host

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_response_tokens(self) -> int:
        return len(self) - self.num_prompt_tokens

    @property
    def awaits_last_token(self) -> bool:
        """Its max_tokens-th token is pending on the device: nothing left to schedule."""
        return self.num_pending > 0 and len(self.token_ids) + self.num_pending - self.num_prompt_tokens >= self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def blocked_on_leader(self) -> bool:
        """A follower waits until its leader's prompt K/V exist, so it can share them."""
        lead = self.leader
        return (lead is not None and not lead.is_finished and self.num_computed_tokens == 0
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def append(self, token_id: int, logprob: float | None, policy_version: int) -> None:
        if len(self.token_ids) == self.num_prompt_tokens:
            self.policy_version = policy_version
        if self.num_pending:
            self.num_pending -= 1
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def reset_response(self) -> None:
        """Drop the response (abort and re-queue: the sample restarts from its prompt)."""
        del self.token_ids[self.num_prompt_tokens:]
        self.num_pending = 0
        self.logprobs.clear()
        self.policy_version = -1
