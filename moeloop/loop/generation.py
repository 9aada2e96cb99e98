"""`RolloutWorker`: turns dataset examples into `Sample`s through the rollout engine.

It owns the mapping prompt -> GRPO group (group ids unique across DP ranks and steps), decodes
response text for the reward, and attaches ground truth and data source.
"""
from __future__ import annotations

from typing import Any

from moeloop.data.dataset import Example
from moeloop.rollout.completion import completions_to_samples
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.types import Sample


class RolloutWorker:
    def __init__(self, engine: Any, tokenizer: Any, max_response_length: int, rank: int = 0):
        self.engine, self.tokenizer, self.rank = engine, tokenizer, rank
        self.max_response_length = max_response_length
        self.eos_ids = tuple(i for i in [tokenizer.eos_token_id] if i is not None)

    def params(self, n: int, temperature: float, top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
               ignore_eos: bool = False, repetition_penalty: float = 1.0, min_p: float = 0.0) -> SamplingParams:
        """`ignore_eos`: generate exactly max_response_length tokens (benchmarks)."""
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, max_tokens=self.max_response_length,
                              stop_token_ids=() if ignore_eos else self.eos_ids, seed=seed, logprobs=True,
                              ignore_eos=ignore_eos)

    def generate(self, examples: list[Example], params: SamplingParams | list[SamplingParams], group_base: int) -> list[Sample]:
        """n samples per example; group id = group_base + example position (callers make bases disjoint)."""
        completions = self.engine.generate([e.prompt_ids for e in examples], params)
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
        return samples
