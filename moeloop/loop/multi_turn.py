"""`MultiTurn`: samples that call tools (assistant turn, tool turn, assistant turn, ...) through the rollout engine.

    completions = engine.generate(prompts, multi_turn.first_params(params))
    completions = multi_turn.run(engine, completions, params_of_each)     # one Completion per sample, all turns

A sample's response is everything after its prompt: its assistant turns (sampled: logprobs, in the loss) and the tool
turns between them (the chat template's tokens around the tools' results: logprob 0, out of the loss;
`Completion.metadata["loss_mask"]`). Every turn after the first is one request whose prompt is the whole sample so
far, so the engine's prefix cache serves it without recomputing, and the last turn's recorded routes
(`Completion.routed_experts`) cover every position. The turns share data.max_response_length; a sample always ends
with an assistant turn (a tool turn that leaves no room for one is not added: the sample ends, "length"). Each turn
draws with its own seed from (the request's seed, sample index, turn), so a run does what it did, on any DP layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moeloop.loop.tools import ToolRunner, ToolTurn, load_parser
from moeloop.rollout.completion import Completion
from moeloop.rollout.sampling_params import SamplingParams


@dataclass
class Episode:
    """One sample's turns so far."""

    first: Completion
    params: SamplingParams
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    last: Completion | None = None
    finish_reason: str = "length"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def add_turn(self, c: Completion) -> None:
        self.response_ids += c.response_ids
        self.logprobs = None if c.logprobs is None or self.logprobs is None else self.logprobs + list(c.logprobs)
        self.loss_mask += [1] * len(c.response_ids)
        self.last, self.finish_reason, self.turns = c, c.finish_reason, self.turns + 1

    def add_tool_turn(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs = None if self.logprobs is None else self.logprobs + [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def completion(self, last_text: str) -> Completion:
        """All turns as one completion; `last_text`: the last assistant turn's text (`Sample.answer_text`)."""
        c = self.last
        return Completion(self.first.request_id, self.first.sample_index,
                          list(self.first.prompt_ids), self.response_ids, self.logprobs, self.finish_reason,
                          min(self.first.policy_version, c.policy_version), None, c.num_preemptions,
                          {"loss_mask": self.loss_mask, "turns": self.turns, "tool_calls": self.tool_calls,
                           "tool_errors": self.tool_errors, "tool_tokens": self.loss_mask.count(0),
                           "final_turn_text": last_text}, c.routed_experts)


class MultiTurn:
    def __init__(self, cfg: Any, tokenizer: Any, max_response_length: int, eos_ids: tuple[int, ...]):
        self.cfg, self.tokenizer, self.eos_ids = cfg, tokenizer, eos_ids
        self.max_response_length = max_response_length
        self.runner, self.parse, self.tool_turn = ToolRunner.from_config(cfg), load_parser(cfg.parser), ToolTurn(tokenizer)

    def first_params(self, params: SamplingParams) -> SamplingParams:
        """The first turn's sampling: at most max_tokens_per_turn tokens."""
        per_turn = self.cfg.max_tokens_per_turn
        return replace(params, max_tokens=min(params.max_tokens, per_turn)) if per_turn else params

    def run(self, engine: Any, completions: list[Completion], params: list[SamplingParams]) -> list[Completion]:
        """Each first-turn completion (with the params of its request, unlimited by `first_params`) taken through
        its turns; one completion per sample, in the same order."""
        episodes = [Episode(c, p) for c, p in zip(completions, params)]
        for e, c in zip(episodes, completions):
            e.add_turn(c)
        live = episodes
        for turn in range(1, self.cfg.max_turns):
            live = self._answer_tools(live)  # (an episode that ended is never read again: its tools ran once)
            if not live:
                break
            prompts = [e.first.prompt_ids + e.response_ids for e in live]
            for e, c in zip(live, engine.generate(prompts, [self._turn_params(e, turn) for e in live])):
                e.add_turn(c)
        return [e.completion(self._text(e.last)) for e in episodes]

    def close(self) -> None:
        self.runner.close()

    def _answer_tools(self, episodes: list[Episode]) -> list[Episode]:
        """Run the tool calls of every episode's last turn (all at once) and add each one's tool turn where an
        assistant turn still fits after it; the episodes that go on."""
        calls = {i: self.parse(self._text(e.last)) for i, e in enumerate(episodes) if e.finish_reason != "abort"}
        calls = {i: c for i, c in calls.items() if c}
        flat = [call for i in calls for call in calls[i]]
        results = iter(self.runner.run(flat))
        live = []
        for i, episode_calls in calls.items():
            e, done = episodes[i], [next(results) for _ in episode_calls]
            e.tool_calls += len(done)
            e.tool_errors += sum(r.status != "ok" for r in done)
            closes = bool(e.last.response_ids) and e.last.response_ids[-1] in self.eos_ids
            ids = self.tool_turn.fitted([r.text for r in done], closes, self.cfg.max_tool_response_tokens)
            if len(e.response_ids) + len(ids) >= self.max_response_length:
                e.finish_reason = "length"  # no room for an assistant turn after it
                continue
            e.add_tool_turn(ids)
            live.append(e)
        return live

    def _turn_params(self, e: Episode, turn: int) -> SamplingParams:
        left = self.max_response_length - len(e.response_ids)
        per_turn = self.cfg.max_tokens_per_turn or left
        seed = e.params.seed
        if seed is not None:
            seed = int(np.random.SeedSequence([seed, e.first.sample_index, turn]).generate_state(1)[0])
        return replace(e.params, n=1, max_tokens=min(left, per_turn), seed=seed)

    def _text(self, c: Completion) -> str:
        return c.text if c.text is not None else self.tokenizer.decode(c.response_ids, skip_special_tokens=True)
