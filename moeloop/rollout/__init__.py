"""moeloop.rollout: the inference engine (scheduler, paged KV blocks + prefix cache, model runner, sampler)."""
from moeloop.rollout.completion import Completion, completions_to_samples
from moeloop.rollout.engine import Engine
from moeloop.rollout.sampling_params import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams", "completions_to_samples"]
