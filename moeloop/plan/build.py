"""`build_plan(cfg)`: every planner figure for one run config, computed from the config alone.

    plan = build_plan(load_config("examples/plan_dsv3_671b.yaml"))
    print(render(plan))          # moeloop.plan.report
The only I/O is reading model.path/config.json when neither plan counts nor plan.hf_config is given.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from moeloop.config.schema import RunConfig
from moeloop.model.config import ModelConfig
from moeloop.parallel.layout import BatchInfo, Layout
from moeloop.plan.accounting import ModelStats, model_stats, stats_from_counts
from moeloop.plan.decode import DecodeEstimate, decode_roofline
from moeloop.plan.interval import expected_overhead, young_daly_interval_s
from moeloop.plan.activations import in_flight_micro_batches
from moeloop.plan.memory import (ADAPTER_BYTES, DTYPE_BYTES, GB, Ledger, avg_seq_tokens, engine_tp, lora_params,
                                 memory_ledger, num_micro_batches, on_training_gpus, stage_ledgers, state_bytes)
from moeloop.parallel.pipeline import schedule_stretch
from moeloop.plan.split import SplitRow, split_rows, verdict
from moeloop.plan.step_time import phase_shares, step_phases, step_seconds, tool_turns
from moeloop.plan.sync_cost import offload_round_trip_s, sync_costs

BF16 = 2


@dataclass
class Plan:
    stats: ModelStats
    layout: Layout
    pool_gpus: int
    problems: list[str]
    ledger: Optional[Ledger]
    gpu_verdict: str
    cpu_verdict: str
    alternatives_gb: dict[str, float]  # peak of the same layout with one setting flipped
    split: list[SplitRow]
    decode: Optional[DecodeEstimate]
    sync_bytes: float
    sync_s: dict[str, float]
    offload_s: float
    phases_s: dict[str, float]
    step_s: float
    checkpoint: dict[str, float]
    seq_tokens: int
    assumptions: list[str] = field(default_factory=list)
    pipeline: list[dict[str, Any]] = field(default_factory=list)  # one row a stage under pipeline parallelism

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.stats.summary(self.seq_tokens), "layout": self.layout.to_dict(), "pool_gpus": self.pool_gpus,
            "problems": self.problems, "ledger": self.ledger.to_dict() if self.ledger else None,
            "gpu_verdict": self.gpu_verdict, "cpu_verdict": self.cpu_verdict, "alternatives_gb": self.alternatives_gb,
            "split": [r.to_dict() for r in self.split], "decode": self.decode.to_dict() if self.decode else None,
            "sync_gb": self.sync_bytes / GB, "sync_s": self.sync_s, "offload_s": self.offload_s,
            "phases_s": self.phases_s, "step_s": self.step_s,
            "phase_shares": phase_shares(self.phases_s, self.step_s), "checkpoint": self.checkpoint,
            "assumptions": self.assumptions, "pipeline": self.pipeline,
        }


def load_stats(cfg: RunConfig) -> ModelStats:
    """Parameter counts (plan.dense_params/expert_params), else plan.hf_config, else model.path/config.json."""
    p = cfg.plan
    if p.dense_params or p.expert_params:
        return stats_from_counts(p.dense_params, p.expert_params, p.active_params)
    if p.hf_config:
        return model_stats(ModelConfig.from_hf_dict(dict(p.hf_config), source="plan.hf_config"))
    return model_stats(ModelConfig.from_pretrained(cfg.model.path))


def sync_transport(cfg: RunConfig) -> str:
    """The link the weight push crosses (a `sync_cost.TRANSPORTS` name): rollout.mode=disaggregated pushes to an
    engine process on this node's GPUs through CUDA IPC (NVLink), whatever sync.transport says."""
    return "cuda_ipc" if cfg.rollout.mode == "disaggregated" else cfg.sync.transport


def build_plan(cfg: RunConfig, stats: Optional[ModelStats] = None) -> Plan:
    cfg.plan.check()
    stats = stats or load_stats(cfg)
    layout = Layout.from_section(cfg.parallel)
    pool = cfg.plan.total_gpus or layout.world_size
    colocated = on_training_gpus(cfg)  # (async too: the engine runs beside the trainer on its GPUs)
    problems = _problems(cfg, stats, layout, pool, colocated)
    ledger = memory_ledger(cfg, stats, layout) if not problems else None
    gpu_v = verdict(ledger.peak_bytes, cfg.hardware.gpu_memory_gb, cfg.plan.tight_fraction) if ledger else "invalid"
    cpu_v = "n/a" if ledger is None else ("fits" if ledger.cpu_bytes_per_node <= cfg.hardware.cpu_memory_gb_per_node * GB else "OOM")
    decode = _decode(cfg, stats, layout, pool, colocated)
    sync_bytes = BF16 * stats.total_params
    sync_s = sync_costs(sync_bytes, cfg.hardware)
    time_sliced = cfg.rollout.mode == "colocated"  # only then does offloaded state go out and back each step
    offload_s = (offload_round_trip_s(ledger.cpu_bytes_per_rank, cfg.hardware.pcie_gbps) if (ledger and time_sliced)
                 else 0.0)
    phases = step_phases(cfg, stats, layout, decode.tokens_per_s if decode else 0.0,
                         sync_s[sync_transport(cfg)], offload_s, decode.gpus if decode else 0)
    step_s = step_seconds(phases, cfg.rollout.generates_ahead and not colocated)
    pipeline = pipeline_rows(cfg, stats, layout) if ledger and layout.pp > 1 else []
    return Plan(stats, layout, pool, problems, ledger, gpu_v, cpu_v,
                _alternatives(cfg, stats, layout) if ledger else {},
                split_rows(cfg, stats, layout, pool, _decode_context(cfg)), decode, sync_bytes, sync_s, offload_s,
                phases, step_s, _checkpoint(cfg, stats, layout, step_s), avg_seq_tokens(cfg), _assumptions(cfg, stats, colocated), pipeline)


def _problems(cfg: RunConfig, stats: ModelStats, layout: Layout, pool: int, colocated: bool) -> list[str]:
    batch = BatchInfo(mini_batch_samples=cfg.actor.ppo_mini_batch_size * cfg.rollout.n)
    problems = layout.validate(stats.model, None, batch)
    if pool < layout.world_size:
        problems.append(f"plan.total_gpus={pool} < training world dp*tp*pp*cp = {layout.world_size}")
    if not colocated and pool - layout.world_size < engine_tp(cfg):
        problems.append(f"rollout.mode={cfg.rollout.mode} leaves {pool - layout.world_size} GPUs for rollout, "
                        f"fewer than one engine of rollout_tp={engine_tp(cfg)}")
    if stats.model is None and "activations" not in cfg.plan.given_gb:
        problems.append("model given as parameter counts: plan.given_gb.activations is required")
    return problems


def _decode_context(cfg: RunConfig) -> int:
    """Average context a decode step attends to: the prompt plus half the response."""
    return (cfg.plan.avg_prompt_tokens or cfg.data.max_prompt_length) + (cfg.plan.avg_response_tokens or cfg.data.max_response_length) // 2


def _decode(cfg: RunConfig, stats: ModelStats, layout: Layout, pool: int, colocated: bool) -> Optional[DecodeEstimate]:
    gpus = pool if colocated else pool - layout.world_size
    tp = engine_tp(cfg)
    if gpus < tp:
        return None
    hw = cfg.hardware
    # (the run's own engine takes rollout.gpu_memory_utilization on GPUs of its own too, as the disaggregated engine
    # process does; `split_rows` keeps DEDICATED_FRACTION for the layouts it only weighs)
    fraction = cfg.rollout.gpu_memory_utilization
    return decode_roofline(stats, gpus, tp, hw.hbm_gbps, hw.gpu_memory_gb, fraction, _decode_context(cfg),
                           cfg.rollout.max_num_seqs, cfg.plan.decode_efficiency)


def _alternatives(cfg: RunConfig, stats: ModelStats, layout: Layout) -> dict[str, float]:
    """Peak GB with activation checkpointing flipped, and with naive vs chunked logits."""
    out = {}
    for name, edit in (("gradient_checkpointing=" + str(not cfg.model.gradient_checkpointing),
                        lambda c: setattr(c.model, "gradient_checkpointing", not c.model.gradient_checkpointing)),
                       ("logits=" + ("naive" if cfg.plan.logits == "chunked" else "chunked"),
                        lambda c: setattr(c.plan, "logits", "naive" if c.plan.logits == "chunked" else "chunked"))):
        alt = copy.deepcopy(cfg)
        edit(alt)
        out[name] = memory_ledger(alt, stats, layout).peak_bytes / GB
    return out


def _checkpoint(cfg: RunConfig, stats: ModelStats, layout: Layout, step_s: float) -> dict[str, float]:
    sb = state_bytes(cfg)
    full = stats.total_params * (sb.weights + sb.optimizer)
    # under LoRA the actor's checkpoint holds the adapters and their optimizer state only
    adapters = sum(map(sum, lora_params(cfg, stats)))
    state = full if not cfg.actor.lora_rank else adapters * (ADAPTER_BYTES.weights + ADAPTER_BYTES.optimizer)
    if cfg.critic.enable:  # saved beside the actor's (its own weights and optimizer)
        state += full
    if cfg.actor.ref_sync_steps:  # the moving reference is saved too
        state += stats.total_params * DTYPE_BYTES.get(cfg.model.dtype, 4)
    nodes = max(1, math.ceil(layout.world_size / cfg.hardware.gpus_per_node))
    save_s = cfg.plan.checkpoint_save_s or state / (cfg.hardware.disk_gbps * GB * nodes)
    mtbf_s = cfg.hardware.mtbf_hours * 3600
    interval = young_daly_interval_s(save_s, mtbf_s)
    return {"state_gb": state / GB, "save_s": save_s, "mtbf_s": mtbf_s, "interval_s": interval,
            "save_every_steps": max(1, round(interval / step_s)) if step_s > 0 else 0,
            "overhead": expected_overhead(save_s, mtbf_s)}


def _assumptions(cfg: RunConfig, stats: ModelStats, colocated: bool) -> list[str]:
    sb = state_bytes(cfg)
    out = [
        f"state bytes/param: weights {sb.weights}, grads {sb.grads}, optimizer {sb.optimizer}; sharding={cfg.plan.sharding} "
        "(dense over dp*cp, experts over expert_dp)",
        f"token budget {cfg.actor.max_tokens_per_micro_batch} tokens per micro-batch per rank; activation checkpointing "
        f"{'on (full, every layer)' if cfg.model.gradient_checkpointing else 'off'}; logits {cfg.plan.logits}",
        f"sequences of {avg_seq_tokens(cfg)} tokens (prompt + response) for FLOPs and micro-batch counts",
        "rollout weights and KV in bf16; "
        + ("the engine keeps both beside the trainer (async)" if cfg.rollout.mode == "async" else
           "the engine sleeps (frees both) while training" if colocated else "the engine has GPUs of its own")
        + f"; the engine uses {cfg.rollout.gpu_memory_utilization:.2f} of each of its GPUs",
        f"decode at {cfg.plan.decode_efficiency:.0%} of the HBM roofline; training at MFU {cfg.plan.mfu:.0%} of "
        f"{cfg.hardware.peak_tflops:g} TFLOP/s",
        "offloaded state lives in pinned host buffers allocated once (no 2x host peak)",
        f"weight push: the bf16 weights over {sync_transport(cfg)} at its bandwidth, one way (no packing, fingerprints "
        "or per-bucket costs: on 2 x H200 with CUDA IPC those made it 4-5x that, BENCHMARKS.md session 21)",
    ]
    calls, tool_tokens = tool_turns(cfg)
    if cfg.rollout.multi_turn.enabled:
        out.append(f"tool turns: {calls:g} calls and {tool_tokens} tool-turn tokens a sample (prefilled, not decoded), "
                   + (f"{cfg.plan.tool_s_per_call:g} s a call" if cfg.plan.tool_s_per_call else
                      "the calls' own time not counted (plan.tool_s_per_call)")
                   + f", {cfg.rollout.multi_turn.concurrency} at once")
    if stats.model is None:
        out.append("model given as parameter counts: per-layer activation, KV and FLOP figures need plan.given_gb")
    if cfg.plan.given_gb:
        out.append("given, not computed: " + ", ".join(f"{k}={v:g} GB" for k, v in sorted(cfg.plan.given_gb.items())))
    return out


def pipeline_rows(cfg: RunConfig, stats: ModelStats, layout: Layout) -> list[dict[str, Any]]:
    """Each pipeline stage as the runtime runs it (`parallel.pipeline`): its decoder layers (runs of them, one a
    chunk; none listed for a model given as parameter counts), the micro-batches' activations it holds at once in the
    schedule's order, its peak GB, and the update's bubble (the share of its compute the stages wait,
    `schedule_stretch` - 1; the same on every stage)."""
    m = num_micro_batches(cfg, layout)
    bubble = schedule_stretch(m, layout.pp, layout.vpp) - 1
    known = stats.model is not None
    return [dict(stage=stage, layers=[(run[0], run[-1]) for run in layout.stage_chunks(len(stats.layers), stage)
                                      if known and run],
                 micro_batches=m, in_flight=in_flight_micro_batches(layout, stage, m),
                 peak_gb=ledger.peak_bytes / GB, bubble=bubble)
            for stage, ledger in enumerate(stage_ledgers(cfg, stats, layout))]
