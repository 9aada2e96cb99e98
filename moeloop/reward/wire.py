"""The JSON shape of the reward service's batched `/score`, both directions.

    request  {"samples": [{"prompt_text", "response_text", "prompt_ids", "response_ids",
                           "ground_truth", "data_source", "metadata"}, ...]}
    response {"results": [{"score": 1.0, "info": {...}} | {"error": "ValueError: ..."}, ...]}
"""
from __future__ import annotations

from typing import Any

from moeloop.types import RewardResult, Sample

_FIELDS = ("prompt_text", "response_text", "prompt_ids", "response_ids", "ground_truth", "data_source", "metadata")


def sample_to_json(sample: Sample) -> dict[str, Any]:
    return {name: getattr(sample, name) for name in _FIELDS}


def sample_from_json(obj: dict[str, Any]) -> Sample:
    if not isinstance(obj, dict):
        raise ValueError(f"/score: each sample must be an object, got {type(obj).__name__}")
    unknown = set(obj) - set(_FIELDS)
    if unknown:
        raise ValueError(f"/score: unknown sample fields {sorted(unknown)}")
    return Sample(**{"prompt_ids": [], **obj})


def result_to_json(result: RewardResult | BaseException) -> dict[str, Any]:
    if isinstance(result, BaseException):
        return {"error": f"{type(result).__name__}: {result}"}
    return {"score": result.score, "info": result.info}


def result_from_json(obj: dict[str, Any]) -> RewardResult:
    """The service's answer for one sample; a per-sample error is raised (the pool retries it)."""
    if "error" in obj:
        raise RuntimeError(f"reward service: {obj['error']}")
    return RewardResult(float(obj["score"]), dict(obj.get("info") or {}))
