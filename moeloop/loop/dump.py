"""Generations written out for people to read: each step's rollouts (`trainer.rollout_data_dir`, as verl's) and the
first held-out generations of each validation (`trainer.log_val_generations`, as verl's), as JSONL.

Under DP every rank's records are gathered to the main rank, which writes them; the order is the global sample order
(rank by rank), so N ranks write what one process would up to that order.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moeloop.parallel.groups import dp_group, dp_size
from moeloop.types import Sample


def sample_record(sample: Sample, step: int, **extra: Any) -> dict[str, Any]:
    """What a reader wants of one sample: prompt, response, answer, score and how it ended."""
    return {"step": step, **extra, "data_source": sample.data_source, "prompt": sample.prompt_text,
            "response": sample.response_text, "ground_truth": sample.ground_truth, "score": sample.reward,
            "reward_status": sample.reward_status, "reward_info": sample.reward_info,
            "advantage": sample.advantages[0] if sample.advantages else None,
            "finish_reason": sample.finish_reason, "response_length": len(sample.response_ids),
            "policy_version": sample.policy_version, "sample_index": sample.metadata.get("sample_index", 0),
            **{k: sample.metadata[k] for k in ("turns", "tool_calls", "tool_errors") if k in sample.metadata}}


def gather_records(records: list[dict[str, Any]], every_rank: bool = False) -> list[dict[str, Any]]:
    """Every DP rank's records, rank after rank (collective under DP; the same list on every rank). `every_rank`:
    every process's (what each generated; without it, the cp * tp ranks of a replica group hold the same samples)."""
    world = dist.get_world_size() if every_rank and dist.is_initialized() else dp_size()
    if world == 1:
        return records
    parts: list[list[dict[str, Any]]] = [[] for _ in range(world)]
    dist.all_gather_object(parts, records, group=None if every_rank else dp_group())
    return [r for part in parts for r in part]


def write_jsonl(path: Path, records: list[dict[str, Any]], append: bool = False) -> None:
    """Written whole (appended when `append`); a value JSON cannot hold (a numpy scalar, say) as its str()."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")


def dump_rollouts(directory: str, step: int, samples: list[Sample], is_main: bool) -> None:
    """`<directory>/<step>.jsonl`: this step's samples, every rank's (collective under DP)."""
    records = gather_records([sample_record(s, step) for s in samples])
    if is_main:
        write_jsonl(Path(directory) / f"{step}.jsonl", records)
