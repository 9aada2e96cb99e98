"""The reward-function plug-in point: the `RewardFn` protocol, the built-ins, dotted paths.

    fn = get_reward_fn("math")                      # built-in
    fn = get_reward_fn("my_pkg.rewards.f1")         # user code: any callable(Sample) -> RewardResult
    fn = get_reward_fn("http", url="http://127.0.0.1:8011")
    fn = get_reward_fn("reward_model", path="/models/rm")    # a transformers sequence classifier

A reward function takes one `Sample` (prompt_text, response_text, response_ids, ground_truth,
metadata, data_source) and returns a `RewardResult` (a float is accepted and wrapped). It may be
sync (run in the pool's threads) or `async def` (run on the pool's event loop). A verl reward function,
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a float or a dict with
"score", works as it is: a dotted path to a function with a `solution_str` parameter is called that way
(`VerlScore`), with the row's `extra_info`.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Awaitable, Callable, Protocol, Union

from moeloop.errors import InputError
from moeloop.types import RewardResult, Sample


class RewardFn(Protocol):
    def __call__(self, sample: Sample) -> Union[RewardResult, float, Awaitable[RewardResult]]: ...


def _math(**_: Any) -> RewardFn:
    from moeloop.reward.rules import math_reward
    return math_reward


def _format(**_: Any) -> RewardFn:
    from moeloop.reward.rules import format_reward
    return format_reward


def _arith(**_: Any) -> RewardFn:
    from moeloop.reward.rules import arith_reward
    return arith_reward


def _code(**options: Any) -> RewardFn:
    from moeloop.reward.code_reward import CodeReward
    from moeloop.reward.sandbox import SandboxLimits
    return CodeReward(SandboxLimits(**options.get("sandbox", {})), python=options.get("python"))


def _http(**options: Any) -> RewardFn:
    from moeloop.reward.remote import RemoteReward
    return RemoteReward(**options)


def _reward_model(**options: Any) -> RewardFn:
    from moeloop.reward.model_reward import model_reward
    return model_reward(**options)


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": _math, "format": _format, "arith": _arith, "code": _code, "http": _http, "reward_model": _reward_model,
}
GROUND_TRUTH_REWARDS = ("math", "arith", "code")  # the built-ins that score against the row's answer
OPTIONLESS_REWARDS = ("math", "format", "arith")  # the built-ins whose factories take no options


def check_options(name: str, options: dict) -> None:
    """Options for a built-in that takes none are an InputError (they were dropped: a misspelt key did nothing)."""
    if name in OPTIONLESS_REWARDS and options:
        raise InputError(f"reward.fn={name} takes no options, got {sorted(options)} (reward.fn_options, or the "
                         f"options of a reward.fns entry)")


def import_by_path(path: str, what: str = "reward.fn", builtins: Any = BUILTIN_REWARDS) -> Any:
    """Import "pkg.module.attr"; errors name the config field `what` (whose built-ins are `builtins`) and say which
    part was not found."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise InputError(f"{what}={path!r} is neither a built-in ({', '.join(builtins)}) nor a dotted path pkg.module.fn")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise InputError(f"{what}={path!r}: cannot import module {module_name!r}: {err}") from None
    if not hasattr(module, attr):
        raise InputError(f"{what}={path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def get_reward_fn(name: str, **options: Any) -> RewardFn:
    """A built-in by name, or user code by dotted path; `options` go to the built-in's factory
    (or, for a dotted path to a class, to its constructor)."""
    if name in BUILTIN_REWARDS:
        check_options(name, options)
        return BUILTIN_REWARDS[name](**options)
    obj = import_by_path(name)
    if isinstance(obj, type):
        return obj(**options)
    if options:
        raise ValueError(f"reward.fn={name!r} is a function; reward.fn_options only apply to built-ins and classes")
    if not callable(obj):
        raise ValueError(f"reward.fn={name!r} is not callable")
    if not VerlScore.fits(obj):
        return obj
    return AsyncVerlScore(obj) if inspect.iscoroutinefunction(obj) else VerlScore(obj)


class VerlScore:
    """A verl-style `compute_score(data_source, solution_str, ground_truth, extra_info=None)` as a `RewardFn`: each
    sample's data source, response text, ground truth and row `extra_info` (`sample.metadata`) by keyword. A class
    rather than a closure, so it pickles for reward.executor=process (the function is pickled by reference)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        params = inspect.signature(fn).parameters
        self.takes_extra = "extra_info" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    @staticmethod
    def fits(fn: Any) -> bool:
        try:
            return "solution_str" in inspect.signature(fn).parameters
        except (TypeError, ValueError):  # (no signature: a builtin)
            return False

    def _kwargs(self, sample: Sample) -> dict[str, Any]:
        kwargs = {"data_source": sample.data_source, "solution_str": sample.response_text,
                  "ground_truth": sample.ground_truth}
        if self.takes_extra:
            kwargs["extra_info"] = sample.metadata.get("extra_info")
        return kwargs

    def __call__(self, sample: Sample) -> Any:
        return self.fn(**self._kwargs(sample))


class AsyncVerlScore(VerlScore):
    """`VerlScore` of an `async def` compute_score (run on the reward pool's event loop)."""

    async def __call__(self, sample: Sample) -> Any:
        return await self.fn(**self._kwargs(sample))


def as_result(value: Any, name: str = "reward fn") -> RewardResult:
    """Normalise what a reward function returned: a `RewardResult`, a number, or (verl's) a dict with "score"
    (its other entries become the info)."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RewardResult(float(value))
    if isinstance(value, dict) and isinstance(value.get("score"), (int, float)) and not isinstance(value["score"], bool):
        return RewardResult(float(value["score"]), {k: v for k, v in value.items() if k != "score"})
    raise TypeError(f"{name} returned {type(value).__name__}; expected RewardResult, a float or a dict with a "
                    f"numeric 'score'")


def is_async_fn(fn: Any) -> bool:
    """True for `async def` functions and objects whose `__call__` is `async def`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))
