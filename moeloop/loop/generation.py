"""`RolloutWorker`: turns dataset examples into `Sample`s through the rollout engine.

It owns the mapping prompt -> GRPO group (group ids unique across DP ranks and steps), decodes
response text for the reward, and attaches ground truth and data source.
"""
from __future__ import annotations

from typing import Any

from moeloop.data.dataset import Example
from moeloop.loop.multi_turn import MultiTurn
from moeloop.rollout.completion import completions_to_samples
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.types import Sample


class RolloutWorker:
    """`multi_turn` (a `MultiTurnSection` with max_turns > 1): samples that call tools go on for more turns
    (`MultiTurn`); each sample's `loss_mask` then keeps the tool turns' tokens out of the loss."""

    def __init__(self, engine: Any, tokenizer: Any, max_response_length: int, rank: int = 0, multi_turn: Any = None):
        self.engine, self.tokenizer, self.rank = engine, tokenizer, rank
        self.max_response_length = max_response_length
        self.eos_ids = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        self.turns = MultiTurn(multi_turn, tokenizer, max_response_length, self.eos_ids) \
            if multi_turn is not None and multi_turn.enabled else None

    def params(self, n: int, temperature: float, top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
               ignore_eos: bool = False, repetition_penalty: float = 1.0, min_p: float = 0.0) -> SamplingParams:
        """`ignore_eos`: generate exactly max_response_length tokens (benchmarks)."""
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, max_tokens=self.max_response_length,
                              stop_token_ids=() if ignore_eos else self.eos_ids, seed=seed, logprobs=True,
                              ignore_eos=ignore_eos)

    def generate(self, examples: list[Example], params: SamplingParams | list[SamplingParams], group_base: int) -> list[Sample]:
        """n samples per example; group id = group_base + example position (callers make bases disjoint)."""
        completions = self._generate([e.prompt_ids for e in examples], params)
        request_ids = list(dict.fromkeys(c.request_id for c in completions))
        if len(request_ids) != len(examples):
            raise RuntimeError(f"engine returned {len(request_ids)} requests for {len(examples)} prompts")
        group_of = {rid: group_base + i for i, rid in enumerate(request_ids)}
        samples = completions_to_samples(completions, group_of)
        for sample, completion in zip(samples, completions):
            example = examples[sample.group_id - group_base]
            sample.prompt_text, sample.ground_truth = example.prompt_text, example.ground_truth
            sample.data_source = example.data_source
            if example.extra_info is not None:
                sample.metadata["extra_info"] = example.extra_info
            if example.messages is not None:
                sample.metadata["messages"] = example.messages
            if completion.text is None:  # the engine decodes when it has a detokenizer (build_engine: the same call)
                sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            if "loss_mask" in completion.metadata:  # multi-turn: the tool turns are out of the loss
                sample.loss_mask = completion.metadata["loss_mask"]
                sample.metadata.update({k: completion.metadata[k] for k in ("turns", "tool_calls", "tool_errors", "tool_tokens", "final_turn_text")})
        return samples

    def _generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
        if self.turns is None:
            return self.engine.generate(prompts, params)
        params = params if isinstance(params, list) else [params] * len(prompts)
        first = self.engine.generate(prompts, [self.turns.first_params(p) for p in params])
        return self.turns.run(self.engine, first, [p for p in params for _ in range(p.n)])

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()
