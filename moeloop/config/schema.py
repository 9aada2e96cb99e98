"""Typed config sections, one dataclass per component; `RunConfig` composes them.

Leaf names follow verl where a verl user would look for them. Rules that involve a single
section live in that section's `check()`; cross-section rules live in `moeloop.config.load`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


def _require(ok: bool, field_name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {rule}")


@dataclass
class ModelSection:
    path: str = "???"  # HF-style model folder (config.json + safetensors + tokenizer)
    dtype: str = "float32"  # float32 | bfloat16
    attn_impl: str = "sdpa"
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024  # chunk size of the memory-lean logprob/entropy kernel

    def check(self) -> None:
        _require(self.dtype in ("float32", "bfloat16"), "model.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _require(self.logprob_chunk_tokens > 0, "model.logprob_chunk_tokens", "must be > 0")


@dataclass
class DataSection:
    train_files: list[str] = field(default_factory=list)  # JSONL / parquet; "synthetic:arith" = built-in task
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_length: int = 256
    max_response_length: int = 64
    truncation: str = "error"  # error | left | right | drop : policy for prompts longer than max_prompt_length
    train_batch_size: int = 8  # prompts per step
    val_batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True

    def check(self) -> None:
        _require(self.truncation in ("error", "left", "right", "drop"), "data.truncation", "must be error|left|right|drop")
        _require(self.train_batch_size > 0, "data.train_batch_size", "must be > 0")
        _require(self.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
        _require(self.max_response_length > 0, "data.max_response_length", "must be > 0")


@dataclass
class RolloutSection:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_bytes: int = 0  # 0 = use gpu_memory_utilization (GPU) or a default budget (CPU)
    gpu_memory_utilization: float = 0.4
    mode: str = "colocated"  # colocated | disaggregated | async
    max_staleness: int = 0
    enforce_eager: bool = False  # no CUDA graphs

    def check(self) -> None:
        _require(self.n >= 1, "rollout.n", "must be >= 1")
        _require(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _require(self.top_k == -1 or self.top_k > 0, "rollout.top_k", "must be -1 (off) or > 0")
        _require(self.mode in ("colocated", "disaggregated", "async"), "rollout.mode", "must be colocated|disaggregated|async")
        _require(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", "must be in (0, 1)")
        _require(self.block_size > 0, "rollout.block_size", "must be > 0")


@dataclass
class RewardServerSection:
    url: str = ""
    token: str = ""


@dataclass
class RewardSection:
    fn: str = "arith"  # built-in name or dotted path "pkg.module.fn"
    concurrency: int = 8
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.1
    fallback: str = "mask"  # mask | neutral | fail
    neutral_score: float = 0.0
    server: RewardServerSection = field(default_factory=RewardServerSection)

    def check(self) -> None:
        _require(self.fallback in ("mask", "neutral", "fail"), "reward.fallback", "must be mask|neutral|fail")
        _require(self.concurrency >= 1, "reward.concurrency", "must be >= 1")
        _require(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _require(self.retries >= 0, "reward.retries", "must be >= 0")


@dataclass
class AlgorithmSection:
    adv_estimator: str = "grpo"  # grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    norm_adv_by_std: bool = True  # False = Dr.GRPO
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    kl_penalty: str = "k1"
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refill_rounds: int = 4
    overlong_penalty: bool = False
    overlong_buffer_len: int = 16
    overlong_penalty_factor: float = 1.0

    def check(self) -> None:
        ests = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
        _require(self.adv_estimator in ests, "algorithm.adv_estimator", f"must be one of {'|'.join(ests)}")
        _require(self.kl_penalty in ("k1", "k2", "k3", "low_var_kl"), "algorithm.kl_penalty", "must be k1|k2|k3|low_var_kl")


@dataclass
class OptimSection:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0  # 1.0 = constant after warmup; < 1 = cosine decay to lr*min_lr_ratio


@dataclass
class OffloadSection:
    params: bool = False
    grads: bool = False
    optimizer: bool = False


@dataclass
class ActorSection:
    optim: OptimSection = field(default_factory=OptimSection)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n samples)
    ppo_epochs: int = 1
    max_tokens_per_micro_batch: int = 4096
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    policy_loss: str = "ppo"  # ppo | gspo
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    recompute_old_logprobs: bool = True  # False = bypass: take old logprobs from the rollout
    offload: OffloadSection = field(default_factory=OffloadSection)

    def check(self, prefix: str = "actor") -> None:
        modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
        _require(self.loss_agg_mode in modes, f"{prefix}.loss_agg_mode", f"must be one of {'|'.join(modes)}")
        _require(self.policy_loss in ("ppo", "gspo"), f"{prefix}.policy_loss", "must be ppo|gspo")
        _require(self.kl_loss_type in ("k1", "k2", "k3", "low_var_kl"), f"{prefix}.kl_loss_type", "must be k1|k2|k3|low_var_kl")
        _require(self.ppo_epochs >= 1, f"{prefix}.ppo_epochs", "must be >= 1")
        _require(self.max_tokens_per_micro_batch > 0, f"{prefix}.max_tokens_per_micro_batch", "must be > 0")
        _require(self.clip_ratio_c > 1.0, f"{prefix}.clip_ratio_c", "must be > 1 (dual-clip bound)")
        _require(self.optim.lr >= 0, f"{prefix}.optim.lr", "must be >= 0")


@dataclass
class CriticSection(ActorSection):
    enable: bool = False
    cliprange_value: float = 0.5


@dataclass
class ParallelSection:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1


@dataclass
class SyncSection:
    transport: str = "inprocess"  # inprocess | broadcast | disk
    bucket_bytes: int = 64 << 20
    verify: bool = True

    def check(self) -> None:
        _require(self.transport in ("inprocess", "broadcast", "disk"), "sync.transport", "must be inprocess|broadcast|disk")
        _require(self.bucket_bytes > 0, "sync.bucket_bytes", "must be > 0")


@dataclass
class CheckpointSection:
    dir: str = ""  # default: <trainer.run_dir>/checkpoints
    save_every: int = 0  # 0 = only at the end
    keep: int = 2
    export_hf_every: int = 0  # 0 = only at the end


@dataclass
class TrainerSection:
    steps: int = 10
    epochs: int = 0  # used by SFT when > 0
    val_every: int = 0
    log: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    run_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class HardwareSection:
    """Inputs of the planner; defaults are an H200-class GPU node."""

    gpus_per_node: int = 8
    gpu_memory_gb: float = 141.0
    hbm_gbps: float = 4233.0
    pcie_gbps: float = 55.0
    nvlink_gbps: float = 450.0
    network_gbps: float = 25.0
    disk_gbps: float = 1.0
    peak_tflops: float = 790.0
    cpu_memory_gb_per_node: float = 2048.0


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    actor: ActorSection = field(default_factory=ActorSection)
    critic: CriticSection = field(default_factory=CriticSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sync: SyncSection = field(default_factory=SyncSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    plan: Optional[dict[str, Any]] = None  # free-form planner inputs (see moeloop.plan)
