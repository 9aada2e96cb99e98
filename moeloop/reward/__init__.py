"""Rewards: reward functions (math, format, arith, code sandbox, http), the `RewardPool` that runs
them per step (concurrency, timeout, retries, circuit breaker, fallback), and the HTTP reward
service with its supervisor. The RL loop needs only `RewardPool.from_config(cfg.reward).score(batch)`."""
from moeloop.errors import UnscorableSample
from moeloop.reward.pool import RewardFailure, RewardPool
from moeloop.reward.registry import BUILTIN_REWARDS, RewardFn, get_reward_fn
from moeloop.reward.sandbox import Sandbox, SandboxLimits, SandboxResult
from moeloop.reward.stats import RewardStats

__all__ = ["BUILTIN_REWARDS", "RewardFailure", "RewardFn", "RewardPool", "RewardStats", "Sandbox",
           "SandboxLimits", "SandboxResult", "UnscorableSample", "get_reward_fn"]
