"""`reward.fns`: several reward functions, their weighted sum the reward (TRL's reward_funcs with reward_weights).

    reward:
      fns:
        - {fn: math}
        - {fn: format, weight: 0.1}
        - {fn: reward_model, weight: 0.5, options: {path: /models/rm}}

Each component is a built-in or a dotted path, as `reward.fn` is (with its own `options`, as `reward.fn_options`).
A sample's reward is the weighted sum; its `reward_info["components"]` holds each component's score under its name
(`name`, by default the fn), which the loop logs as `reward_fn/<name>` means. A failing component fails the sample
(the pool retries it, then falls back). Sync components run in threads (so reward.executor=process is refused
with them); async ones on the pool's loop.
"""
from __future__ import annotations

import asyncio
from typing import Any

from moeloop.errors import InputError
from moeloop.reward.registry import RewardFn, as_result, get_reward_fn, is_async_fn
from moeloop.types import RewardResult, Sample

ENTRY_KEYS = ("fn", "weight", "options", "name")


def component_specs(entries: list[Any]) -> list[tuple[str, str, float, dict]]:
    """(name, fn, weight, options) of each `reward.fns` entry; an entry that is not one is named."""
    specs, names = [], set()
    for i, entry in enumerate(entries):
        where = f"reward.fns[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("fn"), str) or not entry["fn"]:
            raise InputError(f"{where}: must be an object with a reward function name under 'fn', got {entry!r:.80}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise InputError(f"{where}: unknown keys {unknown} (known: {', '.join(ENTRY_KEYS)})")
        weight, options = entry.get("weight", 1.0), entry.get("options") or {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not isinstance(options, dict):
            raise InputError(f"{where}: weight must be a number and options an object")
        name = str(entry.get("name") or entry["fn"].rsplit(".", 1)[-1])
        if name in names:
            raise InputError(f"{where}: a second component named {name!r}; give one a 'name'")
        names.add(name)
        specs.append((name, entry["fn"], float(weight), dict(options)))
    return specs


def component_names(entries: list[Any]) -> list[str]:
    """The names `reward.fns` logs its components under (`reward_fn/<name>`); none without entries."""
    return [name for name, _, _, _ in component_specs(entries)]


class CompositeReward:
    """The weighted sum of component reward functions; an async `RewardFn`."""

    def __init__(self, entries: list[Any]):
        self.components: list[tuple[str, float, RewardFn]] = [
            (name, weight, get_reward_fn(fn, **options)) for name, fn, weight, options in component_specs(entries)]
        if not self.components:
            raise InputError("reward.fns: empty (leave it out to use reward.fn)")

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.components]

    async def __call__(self, sample: Sample) -> RewardResult:
        scores = await asyncio.gather(*(self._one(name, fn, sample) for name, _, fn in self.components))
        total = sum(weight * score for (_, weight, _), score in zip(self.components, scores))
        return RewardResult(total, {"components": dict(zip(self.names, scores))})

    @staticmethod
    async def _one(name: str, fn: RewardFn, sample: Sample) -> float:
        value = await fn(sample) if is_async_fn(fn) else await asyncio.to_thread(fn, sample)  # type: ignore[misc]
        return as_result(value, f"reward.fns component {name}").score
