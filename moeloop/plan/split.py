"""Colocate vs split: for each way of cutting a GPU pool between training and rollout, what training
memory becomes (seed 002 section 3) and what decode throughput the rollout share reaches.

Row 0 keeps every GPU for training and time-slices rollout on the same GPUs (colocated); each further row
gives rollout one more step of lcm(gpus_per_node, tp*pp*cp) GPUs (disaggregated), keeping the model-parallel shape. Fewer training GPUs means a smaller DP and a smaller
expert-DP group, so the sharded optimizer state per GPU grows: the counter-intuitive OOM of seed 002.
A colocated engine gets rollout.gpu_memory_utilization of each GPU; a dedicated one DEDICATED_FRACTION.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from moeloop.config.schema import RunConfig
from moeloop.parallel.layout import BatchInfo, Layout
from moeloop.plan.accounting import ModelStats
from moeloop.plan.decode import DecodeEstimate, decode_roofline
from moeloop.plan.memory import GB, Ledger, engine_tp, memory_ledger

TRAIN_PHASES = ("train", "optimizer_step", "sync")
DEDICATED_FRACTION = 0.9  # vLLM's default gpu_memory_utilization on GPUs of its own


@dataclass
class SplitRow:
    train_gpus: int
    rollout_gpus: int
    colocated: bool
    layout: Optional[Layout]
    problems: list[str] = field(default_factory=list)
    ledger: Optional[Ledger] = None
    decode: Optional[DecodeEstimate] = None
    verdict: str = "invalid"

    @property
    def train_peak_bytes(self) -> float:
        assert self.ledger is not None
        return max(self.ledger.phase_bytes(p) for p in TRAIN_PHASES)

    def to_dict(self) -> dict:
        d = {"train_gpus": self.train_gpus, "rollout_gpus": self.rollout_gpus, "colocated": self.colocated,
             "problems": self.problems, "verdict": self.verdict}
        if self.layout is not None and self.ledger is not None:
            d.update(dp=self.layout.dp, expert_dp=self.layout.expert_dp,
                     optimizer_gb=self.ledger.entries["optimizer"] / GB, resident_gb=self.ledger.resident_bytes / GB,
                     train_peak_gb=self.train_peak_bytes / GB, peak_gb=self.ledger.peak_bytes / GB,
                     peak_phase=self.ledger.peak_phase)
        if self.decode is not None:
            d["decode"] = self.decode.to_dict()
        return d


def verdict(peak_bytes: float, capacity_gb: float, tight_fraction: float) -> str:
    """fits / tight (above tight_fraction of capacity: one long sample away from OOM) / OOM."""
    used = peak_bytes / (capacity_gb * GB)
    return "OOM" if used > 1.0 else "tight" if used > tight_fraction else "fits"


def split_rows(cfg: RunConfig, stats: ModelStats, base: Layout, pool: int, context_tokens: int) -> list[SplitRow]:
    rows, step = [], math.lcm(cfg.hardware.gpus_per_node, base.tp * base.pp * base.cp)
    tp = engine_tp(cfg)
    for k in range(0, pool // step + 1):
        train = pool - k * step
        if train <= 0:
            break
        rows.append(_row(cfg, stats, base, train, pool - train if k else pool, k == 0, tp, context_tokens))
    return rows


def _row(cfg: RunConfig, stats: ModelStats, base: Layout, train: int, rollout: int, colocated: bool,
         engine_tp: int, context_tokens: int) -> SplitRow:
    row = SplitRow(train, rollout, colocated, base.with_world(train))
    if row.layout is None:
        row.problems = [f"{train} GPUs is not a multiple of tp*pp*cp = {base.tp * base.pp * base.cp}"]
        return row
    batch = BatchInfo(mini_batch_samples=cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
    row.problems = row.layout.validate(stats.model, train, batch)
    if row.problems:
        return row
    row.ledger = memory_ledger(cfg, stats, row.layout, colocated=colocated)
    row.verdict = verdict(row.ledger.peak_bytes, cfg.hardware.gpu_memory_gb, cfg.plan.tight_fraction)
    if rollout >= engine_tp:
        hw = cfg.hardware
        row.decode = decode_roofline(stats, rollout, engine_tp, hw.hbm_gbps, hw.gpu_memory_gb,
                                     cfg.rollout.gpu_memory_utilization if colocated else DEDICATED_FRACTION, context_tokens, cfg.rollout.max_num_seqs,
                                     cfg.plan.decode_efficiency)
    return row
