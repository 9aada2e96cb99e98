"""The per-rank memory ledger: every byte a training rank holds, by entry and by phase, for a Layout.

Entries (bytes per rank of the worst pipeline stage): weights, grads, optimizer, activations, logits,
comm_buffers (all-gather / reduce buckets, FSDP unsharded layer, EP all-to-all), sync_buffers, rollout_weights
(with the fused decode's packed copies, `decode_pack_bytes`), rollout_kv (colocated engine at its memory fraction),
ref_weights (the KL reference, a second copy of the weights in model.dtype, sharded as the actor's; none under LoRA:
the actor with its adapters off), critic_state
(PPO's critic: weights, grads and optimizer as the actor's), reserve. `plan.given_gb` replaces any of them. The
reference and the critic stay on the GPU in every phase.
Phases are the moments an entry set is live at once:
    train           weights + grads + optimizer (unless offloaded) + activations + logits + comm_buffers
    optimizer_step  weights + grads + optimizer (unless the step runs on CPU) + comm_buffers
    sync            resident state + sync_buffers (+ rollout_weights when colocated)
    rollout         resident state not offloaded + rollout_weights + rollout_kv          (colocated only)
rollout.mode=async runs the engine on the training GPUs beside the trainer (the RL loop's `RolloutAhead`): its
weights and KV are live in every phase.
The peak is the largest phase; offload (verl-style: state moves to pinned CPU buffers allocated once, and
comes back for the phase that needs it) only removes entries from the phases outside its use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moeloop.config.schema import RunConfig
from moeloop.model.config import ModelConfig
from moeloop.errors import InputError
from moeloop.parallel.layout import Layout
from moeloop.plan.accounting import ModelStats, lora_layer_params, model_stats
from moeloop.plan.activations import (BF16, alltoall_bytes, logits_bytes, stage_activation_bytes)

GB = 1e9
ENTRIES = ("weights", "grads", "optimizer", "activations", "logits", "comm_buffers", "sync_buffers",
           "rollout_weights", "rollout_kv", "ref_weights", "critic_state", "reserve")
RESIDENT_COPIES = ("ref_weights", "critic_state")  # live in every phase
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class Ledger:
    stage: int  # the pipeline stage whose ranks peak highest
    entries: dict[str, float]  # bytes per rank
    phases: dict[str, tuple[str, ...]]  # phase -> entries live in it
    given: tuple[str, ...] = ()  # entries taken from plan.given_gb
    cpu_bytes_per_rank: float = 0.0
    cpu_bytes_per_node: float = 0.0
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> float:
        return sum(self.entries[e] for e in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.phase_bytes(self.peak_phase)

    @property
    def resident_bytes(self) -> float:
        """Training state that lives on the GPU for the whole step without offload: weights, grads, optimizer."""
        return self.entries["weights"] + self.entries["grads"] + self.entries["optimizer"]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "entries_gb": {k: v / GB for k, v in self.entries.items()},
                "phases_gb": {p: self.phase_bytes(p) / GB for p in self.phases}, "peak_phase": self.peak_phase,
                "peak_gb": self.peak_bytes / GB, "given": list(self.given),
                "cpu_gb_per_rank": self.cpu_bytes_per_rank / GB, "cpu_gb_per_node": self.cpu_bytes_per_node / GB}


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int


ADAPTER_BYTES = StateBytes(4, 4, 8)  # LoRA adapters: fp32 whatever model.dtype (train.lora), torch AdamW's m and v


def state_bytes(cfg: RunConfig) -> StateBytes:
    """Bytes per parameter; 0 in plan means torch AdamW on the trained weights: fp32 master weights, grads and Adam
    state when model.fp32_master_weights (the default; the forward's bf16 casts are transient) and the weights train
    in full, else in model.dtype (a LoRA base stays in model.dtype)."""
    d = DTYPE_BYTES.get(cfg.model.dtype, 4)
    if cfg.model.fp32_master_weights and not cfg.actor.lora_rank:
        d = 4
    p = cfg.plan
    return StateBytes(p.weight_bytes or d, p.grad_bytes or d, p.optimizer_bytes or 2 * d)


def num_micro_batches(cfg: RunConfig, layout: Layout) -> int:
    """Micro-batches per mini-batch on one DP rank: the token budget cut (plan.num_micro_batches overrides), under an
    interleaved pipeline rounded up to a multiple of pp as the trainer does."""
    if cfg.plan.num_micro_batches:
        return cfg.plan.num_micro_batches
    samples = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    tokens = samples * avg_seq_tokens(cfg)
    m = max(1, math.ceil(tokens / (layout.dp * layout.cp * cfg.actor.max_tokens_per_micro_batch)))
    return -(-m // layout.pp) * layout.pp if layout.vpp > 1 else m


def avg_seq_tokens(cfg: RunConfig) -> int:
    return (cfg.plan.avg_prompt_tokens or cfg.data.max_prompt_length) + (cfg.plan.avg_response_tokens or cfg.data.max_response_length)


def rank_params(stats: ModelStats, layout: Layout, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters on one rank of `stage` before any data-parallel sharding."""
    layers = [stats.layers[i] for i in stage_layer_ids(layout, len(stats.layers))[stage]]
    dense = sum(l.tp_split(layout.tp) + l.replicated for l in layers)
    last = stage == layout.pp - 1
    if stage == 0:  # the embedding and the head are whole on each tp rank (no vocabulary split)
        dense += stats.embedding
    if last:
        dense += (stats.lm_head or (stats.embedding if layout.pp > 1 else 0)) + stats.final_norm
    expert = sum(l.experts for l in layers) / layout.expert_shards
    return dense, expert


def stage_layer_ids(layout: Layout, num_layers: int) -> list[list[int]]:
    """The decoder layers of each pipeline stage: its chunks' runs (`Layout.stage_chunks`), as the runtime splits
    them (`parallel.pipeline.split_stages`)."""
    if num_layers <= 1 and layout.pp > 1:
        return [list(range(num_layers))] + [[] for _ in range(layout.pp - 1)]
    return [[i for run in layout.stage_chunks(num_layers, stage) for i in run] for stage in range(layout.pp)]


def memory_ledger(cfg: RunConfig, stats: ModelStats, layout: Layout, colocated: bool | None = None) -> Ledger:
    """The ledger of the worst stage (highest peak) for `layout`; `colocated` defaults to rollout.mode."""
    ledgers = stage_ledgers(cfg, stats, layout, colocated)
    # ties (a rollout phase equal on every stage) go to the stage with the larger phases below the peak
    return max(ledgers, key=lambda led: sorted((led.phase_bytes(p) for p in led.phases), reverse=True))


def stage_ledgers(cfg: RunConfig, stats: ModelStats, layout: Layout, colocated: bool | None = None) -> list[Ledger]:
    """One ledger per pipeline stage."""
    colocated = on_training_gpus(cfg) if colocated is None else colocated
    return [_stage_ledger(cfg, stats, layout, s, colocated) for s in range(layout.pp)]


def predict_peak_bytes(cfg: RunConfig, model_cfg: ModelConfig | None = None, layout: Layout | None = None,
                       include_reserve: bool = False) -> int:
    """Planned peak GPU bytes of the worst rank, comparable to `torch.cuda.max_memory_allocated()`.

    The trainer calls it once at start-up and logs it beside the measured peak. `model_cfg` defaults to the
    plan's model (plan counts, plan.hf_config or model.path); `layout` to cfg.parallel. `reserve` (CUDA
    context, NCCL) is outside torch's allocator, so it is left out unless asked for.
    """
    from moeloop.plan.build import load_stats  # the loader reads files; the ledger itself does not

    stats = model_stats(model_cfg) if model_cfg is not None else load_stats(cfg)
    ledger = memory_ledger(cfg, stats, layout or Layout.from_section(cfg.parallel))
    return int(ledger.peak_bytes - (0 if include_reserve else ledger.entries["reserve"]))


def on_training_gpus(cfg: RunConfig) -> bool:
    """The engine runs on the training GPUs: time-sliced (colocated) or beside the trainer (async)."""
    return cfg.rollout.mode in ("colocated", "async")


def _stage_ledger(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int, colocated: bool) -> Ledger:
    entries = _state_entries(cfg, stats, layout, stage)
    entries.update(_work_entries(cfg, stats, layout, stage))
    entries.update(_rollout_entries(cfg, stats, layout, colocated))
    entries.update(_other_models(cfg, stats, layout, stage))
    entries["reserve"] = cfg.plan.reserve_gb * GB
    given = _apply_given(cfg, entries)
    ledger = Ledger(stage, entries, _phases(cfg, colocated), given)
    _add_cpu(cfg, layout, ledger)
    return ledger


def state_parts(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int) -> dict[str, tuple[float, float]]:
    """(dense, expert) bytes per rank of weights, grads and optimizer: experts shard over expert_dp, dense over dp*cp.
    Under LoRA (actor.lora_rank > 0) the adapters join the weights (fp32, ADAPTER_BYTES), and grads and optimizer are
    theirs only; routed experts' adapters count and shard as their experts."""
    dense, expert = rank_params(stats, layout, stage)
    sb, sharding = state_bytes(cfg), cfg.plan.sharding
    def part(nbytes: int, sharded: bool, dense: float, expert: float) -> tuple[float, float]:
        if not sharded:
            return nbytes * dense, nbytes * expert
        return nbytes * dense / layout.dp_cp, nbytes * expert / layout.expert_dp
    parts = {"weights": part(sb.weights, sharding == "fsdp", dense, expert),
             "grads": part(sb.grads, sharding == "fsdp", dense, expert),
             "optimizer": part(sb.optimizer, sharding != "none", dense, expert)}
    if not cfg.actor.lora_rank:
        return parts
    adapters, ab = rank_lora_params(cfg, stats, layout, stage), ADAPTER_BYTES
    weights = [w + a for w, a in zip(parts["weights"], part(ab.weights, sharding == "fsdp", *adapters))]
    return {"weights": (weights[0], weights[1]),
            "grads": part(ab.grads, sharding == "fsdp", *adapters),
            "optimizer": part(ab.optimizer, sharding != "none", *adapters)}


def full_training(cfg: RunConfig) -> RunConfig:
    """`cfg` without LoRA (the critic's state; the actor's when lora_rank is 0)."""
    return replace(cfg, actor=replace(cfg.actor, lora_rank=0)) if cfg.actor.lora_rank else cfg


def rank_lora_params(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int) -> tuple[float, float]:
    """(dense, expert) LoRA adapter parameters on one rank of `stage` before data-parallel sharding: split over tp
    as `parallel.tensor` splits them (`lora_layer_params`), the routed experts' over ep * etp as the weights they
    adapt; zeros without LoRA."""
    ids = stage_layer_ids(layout, len(stats.layers))[stage]
    dense, expert = lora_params(cfg, stats, layout.tp)
    return sum(dense[i] for i in ids), sum(expert[i] for i in ids) / layout.expert_shards


def lora_params(cfg: RunConfig, stats: ModelStats, tp: int = 1) -> tuple[list[float], list[int]]:
    """(dense, expert) LoRA adapter parameters of each decoder layer (zeros without LoRA); `tp`: a tp rank's dense
    ones."""
    if not cfg.actor.lora_rank:
        return [0] * len(stats.layers), [0] * len(stats.layers)
    if stats.model is None:
        raise InputError("actor.lora_rank: the planner counts adapters from the model's config (plan.hf_config or "
                         "model.path), not from bare parameter counts (plan.dense_params ...)")
    return lora_layer_params(stats.model, cfg.actor, tp)


def _state_entries(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int) -> dict[str, float]:
    return {name: d + e for name, (d, e) in state_parts(cfg, stats, layout, stage).items()}


def _other_models(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int) -> dict[str, float]:
    """The KL reference (with actor.use_kl_loss or algorithm.use_kl_in_reward: loaded in model.dtype, sharded as the
    actor's weights) and the critic (critic.enable: its own weights, grads and optimizer, the actor's sizes without
    LoRA: the critic trains in full)."""
    state = _state_entries(full_training(cfg), stats, layout, stage)
    params_per_rank = state["weights"] / state_bytes(full_training(cfg)).weights
    uses_ref = (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.actor.lora_rank  # (LoRA: the
    # reference is the actor with its adapters off, no copy)
    return {"ref_weights": params_per_rank * DTYPE_BYTES.get(cfg.model.dtype, 4) if uses_ref else 0.0,
            "critic_state": sum(state.values()) if cfg.critic.enable else 0.0}


LENT_BUFFERS = 2  # `sync.transport.LENT_BUFFERS` (the planner imports no torch; tests/test_plan.py checks they agree)


def _work_entries(cfg: RunConfig, stats: ModelStats, layout: Layout, stage: int) -> dict[str, float]:
    m, tokens = stats.model, cfg.actor.max_tokens_per_micro_batch
    bucket = cfg.plan.comm_bucket_mb * 1e6
    comm = 2 * bucket if layout.dp_cp > 1 or layout.expert_dp > 1 else 0.0
    # buckets the trainer holds: an engine process's two lent buffers, two for a broadcast, else the one being packed
    held = (LENT_BUFFERS if cfg.rollout.mode == "disaggregated" else 2 if cfg.sync.transport == "broadcast" else 1)
    sync = cfg.sync.bucket_bytes * held
    if m is None:  # bare parameter counts: activations and logits must come from plan.given_gb
        return {"activations": 0.0, "logits": 0.0, "comm_buffers": comm, "sync_buffers": sync}
    ids = stage_layer_ids(layout, m.num_layers)[stage]
    mb = num_micro_batches(cfg, layout)
    acts = stage_activation_bytes(m, layout, ids, tokens, mb, stage, cfg.model.gradient_checkpointing)
    last = stage == layout.pp - 1
    logits = logits_bytes(m, layout, tokens, cfg.model.logprob_chunk_tokens, cfg.plan.logits == "chunked") if last else 0.0
    comm += alltoall_bytes(m, layout, tokens)
    if cfg.plan.sharding == "fsdp":  # one layer unsharded for compute, one prefetched
        comm += 2 * BF16 * max((l.tp_split(layout.tp) + l.whole + l.experts / layout.expert_shards
                                for l in (stats.layers[i] for i in ids)), default=0)
    sync += BF16 * m.vocab_size * m.hidden_size  # the largest tensor gathered whole (embedding / lm_head)
    return {"activations": acts, "logits": logits, "comm_buffers": comm, "sync_buffers": sync}


# `rollout.decode_packs.ROW_MAX_D`, copied here so the planner stays free of the engine's imports (a test
# checks the two agree): the widest row a one-token decode program holds whole
ROW_MAX_D = 2048


def decode_pack_bytes(m: ModelConfig | None, rollout_tp: int = 1) -> float:
    """Bytes the CUDA engine's fused decode derives from the weights and keeps beside them
    (`rollout.decode_packs.derive_decode_weights`): each GQA layer's packed q|k|v copy (bf16, as the planner's
    engine weights, split like them over the engine's TP) and, where one program holds its rows, each softmax MoE
    layer's composed router ([E, H * Dh + D] fp32, `ComposedRouter`). 0 without a model config, or for MLA (no fused
    decode)."""
    if m is None or m.is_mla:
        return 0.0
    attn = m.num_heads * m.head_dim
    qkv = BF16 * m.num_layers * m.hidden_size * (attn + 2 * m.num_kv_heads * m.head_dim) / rollout_tp
    fits = m.num_experts and m.scoring_func == "softmax" and max(attn, m.hidden_size) <= ROW_MAX_D
    routers = 4 * m.num_experts * (attn + m.hidden_size) * len(m.moe_layers) if fits else 0
    return qkv + routers


def engine_tp(cfg: RunConfig) -> int:
    """GPUs one rollout engine spans (`parallel.rollout_tp`, another engine's layout planned); 0 means 1: moeloop's
    engine, which holds the whole model on each rank whatever the trainer's layout (no engine tensor parallelism)."""
    return cfg.parallel.rollout_tp or 1


def _rollout_entries(cfg: RunConfig, stats: ModelStats, layout: Layout, colocated: bool) -> dict[str, float]:
    if not colocated:
        return {"rollout_weights": 0.0, "rollout_kv": 0.0}
    rollout_tp = engine_tp(cfg)
    weights = BF16 * stats.total_params / rollout_tp + decode_pack_bytes(stats.model, rollout_tp)
    budget = cfg.rollout.gpu_memory_utilization * cfg.hardware.gpu_memory_gb * GB
    kv = float(cfg.rollout.kv_cache_bytes) if cfg.rollout.kv_cache_bytes else max(0.0, budget - weights)
    return {"rollout_weights": weights, "rollout_kv": kv}


def _apply_given(cfg: RunConfig, entries: dict[str, float]) -> tuple[str, ...]:
    unknown = sorted(set(cfg.plan.given_gb) - set(ENTRIES))
    if unknown:
        raise ValueError(f"plan.given_gb: unknown entries {unknown} (known: {', '.join(ENTRIES)})")
    for name, gb in cfg.plan.given_gb.items():
        entries[name] = float(gb) * GB
    return tuple(sorted(cfg.plan.given_gb))


def _phases(cfg: RunConfig, colocated: bool) -> dict[str, tuple[str, ...]]:
    """The live entries of each phase; with an async engine on the training GPUs (it runs during training), its
    weights and KV join every phase."""
    off = cfg.actor.offload
    cpu_step = cfg.plan.cpu_optimizer_step
    opt_fwd = () if (off.optimizer or cpu_step) else ("optimizer",)
    opt_step = () if cpu_step else ("optimizer",)
    resident = ("weights",) + (() if off.grads else ("grads",)) + opt_fwd
    idle = (() if off.params else ("weights",)) + (() if off.grads else ("grads",)) + opt_fwd
    phases = {
        "train": ("weights", "grads") + opt_fwd + ("activations", "logits", "comm_buffers", "reserve"),
        "optimizer_step": ("weights", "grads") + opt_step + ("comm_buffers", "reserve"),
        "sync": resident + ("sync_buffers",) + (("rollout_weights",) if colocated else ()) + ("reserve",),
    }
    if colocated:
        phases["rollout"] = idle + ("rollout_weights", "rollout_kv", "reserve")
    if colocated and cfg.rollout.mode == "async":
        engine = ("rollout_weights", "rollout_kv")
        phases = {name: tuple(e for e in members if e not in engine) + engine for name, members in phases.items()}
    return {name: members + RESIDENT_COPIES for name, members in phases.items()}


def _add_cpu(cfg: RunConfig, layout: Layout, ledger: Ledger) -> None:
    """Pinned host buffers for what offload moves (allocated once and reused: no 2x host peak)."""
    off, e = cfg.actor.offload, ledger.entries
    moved = (e["weights"] if off.params else 0.0) + (e["grads"] if off.grads else 0.0)
    moved += e["optimizer"] if (off.optimizer or cfg.plan.cpu_optimizer_step) else 0.0
    ledger.cpu_bytes_per_rank = moved
    ledger.cpu_bytes_per_node = moved * min(cfg.hardware.gpus_per_node, layout.world_size)
