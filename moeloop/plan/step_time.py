"""Step-time model: the phase shares seed 002 section 6 says to watch instead of MFU.

    gen            decoded response tokens / decode roofline of the rollout share (x decode_efficiency); ReMax adds
                   a greedy response per prompt. With tool turns (rollout.multi_turn), their tokens are prefilled, not
                   decoded: forward FLOPs / (rollout GPUs * peak * plan.mfu)
    tools          samples * tool calls * plan.tool_s_per_call / rollout.multi_turn.concurrency
    reward         samples * plan.reward_s_per_sample / reward.concurrency (ReMax: its greedy responses too)
    old_log_prob   forward FLOPs when the pass runs (`RunConfig.old_logprob_pass`) / (train GPUs * peak * plan.mfu)
    ref            forward FLOPs (with a KL term)     / same
    update_actor   train FLOPs * ppo_epochs          / same
                   (these three x the pipeline's stretch under parallel.pp: `pipeline_stretch`)
    update_weights sync bytes / the configured transport (disaggregated: CUDA IPC over NVLink, `build.sync_transport`)
    offload        colocated only: training state to host and back over PCIe
Phases run one after another, except where the next batch is generated ahead on devices of its own
(rollout.mode=disaggregated with max_staleness >= 1): generation + reward overlap the trainer side, and the weight
push waits for both (the RL loop joins the rollout before it pushes). rollout.mode=async generates ahead on the
training GPUs, where both sides are HBM-bound and share it: modelled in turn, as measured on the H200 (0.720 s a
step against 0.750 s colocated, BENCHMARKS.md session 20).
Prompt prefill and the long tail of generation lengths (per turn, with tool calls) are not modelled.
"""
from __future__ import annotations

from moeloop.config.schema import RunConfig
from moeloop.plan.accounting import ModelStats
from moeloop.parallel.layout import Layout
from moeloop.parallel.pipeline import schedule_stretch
from moeloop.plan.memory import avg_seq_tokens, num_micro_batches

TFLOP = 1e12


def tool_turns(cfg: RunConfig) -> tuple[float, int]:
    """(tool calls, tool-turn tokens) of a sample: plan.tool_calls_per_sample / plan.avg_tool_tokens, or their
    defaults with rollout.multi_turn on (see PlanSection); (0, 0) with it off."""
    mt = cfg.rollout.multi_turn
    if not mt.enabled:
        return 0.0, 0
    calls = cfg.plan.tool_calls_per_sample or float(mt.max_turns - 1)
    response = cfg.plan.avg_response_tokens or cfg.data.max_response_length
    return calls, min(cfg.plan.avg_tool_tokens or int(calls * mt.max_tool_response_tokens), response)


def pipeline_stretch(layout: Layout, passes_per_fill: int) -> float:
    """How much longer than its compute a trainer pass takes on `layout.pp` stages when its pipeline fills and drains
    once every `passes_per_fill` micro-batches of a stage, in the runtime's order (`parallel.pipeline.schedule_stretch`,
    balanced stages): (m + pp - 1) / m with one chunk a stage (Megatron's 1F1B bubble), about (m + (pp - 1) / vpp) / m
    interleaved; 1 without pipeline parallelism. moeloop's update fills once a mini-batch, its forward-only passes once
    a step (`parallel.pipeline`)."""
    if layout.pp == 1:
        return 1.0
    return schedule_stretch(max(1, passes_per_fill), layout.pp, layout.vpp)


def step_phases(cfg: RunConfig, stats: ModelStats, layout: Layout, decode_tokens_per_s: float,
                sync_s: float, offload_s: float, rollout_gpus: int = 0) -> dict[str, float]:
    """Seconds per phase of one RL step on the training `layout`; `rollout_gpus`: the GPUs that generate (they
    prefill the tool turns)."""
    train_gpus = layout.world_size
    samples = cfg.data.train_batch_size * cfg.rollout.n
    generated = samples + (cfg.data.train_batch_size if cfg.algorithm.adv_estimator == "remax" else 0)
    response = cfg.plan.avg_response_tokens or cfg.data.max_response_length
    calls, tool_tokens = tool_turns(cfg)
    seq = avg_seq_tokens(cfg)
    tokens = samples * seq
    peak_s = cfg.hardware.peak_tflops * TFLOP * cfg.plan.mfu
    flops_s = train_gpus * peak_s
    per_mini = num_micro_batches(cfg, layout)  # a stage's micro-batches a mini-batch
    mini_batches = max(1, cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
    fwd = tokens * stats.forward_flops_per_token(seq) / flops_s * pipeline_stretch(layout, per_mini * mini_batches)
    train = (tokens * stats.train_flops_per_token(seq, cfg.model.gradient_checkpointing) * cfg.actor.ppo_epochs / flops_s
             * pipeline_stretch(layout, per_mini))
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    gen = generated * (response - tool_tokens) / decode_tokens_per_s if decode_tokens_per_s > 0 else 0.0
    if tool_tokens and rollout_gpus:
        gen += samples * tool_tokens * stats.forward_flops_per_token(seq) / (rollout_gpus * peak_s)
    return {
        "gen": gen,
        "tools": samples * calls * cfg.plan.tool_s_per_call / cfg.rollout.multi_turn.concurrency,
        "reward": generated * cfg.plan.reward_s_per_sample / cfg.reward.concurrency,
        "old_log_prob": fwd if cfg.old_logprob_pass(cfg.rollout.generates_ahead) else 0.0,
        "ref": fwd if use_ref else 0.0,
        "update_actor": train,
        "update_weights": sync_s,
        "offload": offload_s,
    }


def step_seconds(phases: dict[str, float], ahead: bool) -> float:
    if ahead:
        rollout_side = phases["gen"] + phases.get("tools", 0.0) + phases["reward"]
        trainer_side = sum(phases.values()) - rollout_side - phases["update_weights"]
        return max(rollout_side, trainer_side) + phases["update_weights"]
    return sum(phases.values())


def phase_shares(phases: dict[str, float], step_s: float) -> dict[str, float]:
    return {k: (v / step_s if step_s > 0 else 0.0) for k, v in phases.items()}
