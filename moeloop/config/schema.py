"""Typed config sections, one dataclass per component; `RunConfig` composes them.

Leaf names follow verl where a verl user would look for them. Rules that involve a single
section live in that section's `check()`; cross-section rules live in `moeloop.config.load`.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from moeloop.errors import InputError


def _require(ok: bool, field_name: str, rule: str) -> None:
    if not ok:
        raise InputError(f"{field_name}: {rule}")


@dataclass
class ModelSection:
    path: str = "???"  # HF-style model folder (config.json + safetensors + tokenizer)
    dtype: str = "float32"  # float32 | bfloat16
    attn_impl: str = "sdpa"
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024  # chunk size of the memory-lean logprob/entropy kernel
    # with dtype=bfloat16: the trained models (actor, critic) keep their trainable weights, grads and Adam state in
    # fp32 and compute in bf16 (verl's FSDP mixed precision, TRL's bf16 autocast; moeloop.train.precision). false:
    # pure bf16 training, half the state, but an update below bf16's resolution is lost (lr 1e-6 hardly moves it)
    fp32_master_weights: bool = True

    def check(self) -> None:
        _require(self.dtype in ("float32", "bfloat16"), "model.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _require(self.logprob_chunk_tokens > 0, "model.logprob_chunk_tokens", "must be > 0")


@dataclass
class DataSection:
    train_files: list[str] = field(default_factory=list)  # JSONL / parquet (one path: a string will do); "synthetic:arith" = built-in
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # dotted = nested, e.g. reward_model.ground_truth (verl's parquet files)
    response_key: str = "response"  # SFT target: a string, or assistant chat messages (loss on those turns); a row
    #                                without it whose prompt messages hold assistant turns learns every assistant turn
    max_prompt_length: int = 256
    max_response_length: int = 64
    truncation: str = "error"  # error | left | right | drop : policy for prompts longer than max_prompt_length
    train_batch_size: int = 8  # prompts per step
    train_max_samples: int = -1  # training rows used: the first this-many (-1 = all, as verl's)
    val_batch_size: int = 64  # held-out prompts per generate call of the validation
    val_max_samples: int = -1  # held-out prompts validated: the first this-many rows (-1 = all, as verl's)
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True

    def check(self) -> None:
        _require(self.truncation in ("error", "left", "right", "drop"), "data.truncation", "must be error|left|right|drop")
        _require(self.train_batch_size > 0, "data.train_batch_size", "must be > 0")
        _require(self.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
        _require(self.max_response_length > 0, "data.max_response_length", "must be > 0")
        _require(self.val_batch_size > 0, "data.val_batch_size", "must be > 0")
        for name in ("train_max_samples", "val_max_samples"):
            _require(getattr(self, name) == -1 or getattr(self, name) > 0, f"data.{name}", "must be -1 (all) or > 0")


@dataclass
class ValKwargs:
    """The sampled validation's sampling (verl's rollout.val_kwargs); None = the training rollout's value. Its sample
    count is trainer.val_samples; the greedy validation always runs too."""
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None


def _check_sampling(s: RolloutSection | ValKwargs, prefix: str) -> None:
    """The sampling fields of the rollout or its resolved val_kwargs (`RolloutSection.val_sampling`)."""
    _require(s.temperature >= 0, f"{prefix}.temperature", "must be >= 0")
    _require(0 < s.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]")
    _require(s.top_k == -1 or s.top_k > 0, f"{prefix}.top_k", "must be -1 (off) or > 0")
    _require(0 < s.repetition_penalty < float("inf"), f"{prefix}.repetition_penalty",
             "must be finite and > 0 (1 = off)")
    _require(0 <= s.min_p <= 1, f"{prefix}.min_p", "must be in [0, 1] (0 = off)")


@dataclass
class MultiTurnSection:
    """Multi-turn tool calling (verl's rollout.multi_turn): an assistant turn that calls tools (Hermes format by
    default: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) gets their results as a tool turn of the chat
    template, and the sample goes on, up to `max_turns` assistant turns within data.max_response_length tokens in all.
    The tool turns' tokens are in the response but out of the loss (`Sample.loss_mask`)."""
    tools: list[str] = field(default_factory=list)  # built-in names (calculator) or dotted paths to fn(**arguments)
    max_turns: int = 1  # assistant turns per sample; > 1 (with tools) turns multi-turn on
    parser: str = "hermes"  # how tool calls are read from a turn's text: hermes, or a dotted path fn(text) -> calls
    max_tokens_per_turn: int = 0  # an assistant turn's tokens at most (0 = the response budget left)
    max_tool_response_tokens: int = 256  # a tool turn's tokens at most (its results' text is cut to fit)
    timeout_s: float = 10.0  # a tool call's time; past it, the call's result is an error message
    concurrency: int = 8  # tool calls running at once

    @property
    def enabled(self) -> bool:
        return self.max_turns > 1

    def check(self) -> None:
        _require(self.max_turns >= 1, "rollout.multi_turn.max_turns", "must be >= 1")
        _require(self.max_turns == 1 or bool(self.tools), "rollout.multi_turn.tools",
                 "must name at least one tool when rollout.multi_turn.max_turns > 1")
        _require(not self.tools or self.max_turns > 1, "rollout.multi_turn.max_turns",
                 "must be > 1 when rollout.multi_turn.tools are set (1 turn never sees a tool's result)")
        _require(self.max_tokens_per_turn >= 0, "rollout.multi_turn.max_tokens_per_turn", "must be >= 0 (0 = all left)")
        _require(self.max_tool_response_tokens > 0, "rollout.multi_turn.max_tool_response_tokens", "must be > 0")
        _require(self.timeout_s > 0, "rollout.multi_turn.timeout_s", "must be > 0")
        _require(self.concurrency >= 1, "rollout.multi_turn.concurrency", "must be >= 1")


@dataclass
class RolloutSection:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # HF/vLLM semantics and order (`SamplingParams`); greedy responses (the greedy validation, ReMax's baselines) take
    # the repetition penalty too, not min-p
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_bytes: int = 0  # 0 = use gpu_memory_utilization (GPU) or a default budget (CPU)
    gpu_memory_utilization: float = 0.4
    mode: str = "colocated"  # colocated | disaggregated | async
    max_staleness: int = 0  # async: >= 1; disaggregated: 0 = on-policy, >= 1 = the next batch generated ahead
    device: str = ""  # disaggregated: the engine process's device ("" = cpu for a CPU trainer, else the GPU after
    #                   this node's training GPUs: LOCAL_WORLD_SIZE + LOCAL_RANK)
    threads: int = 0  # disaggregated on CPU: the engine process's intra-op threads (0 = the trainer's; half when ahead)
    enforce_eager: bool = False  # no CUDA graphs
    # prompt + response tokens of one sequence (sizes block tables and CUDA graphs); the RL loop sets it to
    # data.max_prompt_length + data.max_response_length
    max_model_len: int = 4096
    ignore_eos: bool = False  # generate exactly data.max_response_length tokens (benchmarks)
    # each completion carries the experts that computed each of its positions (Completion.routed_experts); on for
    # actor.router_replay=R3. The fused decode then routes in a kernel of its own (the expert kernels' folded
    # ranking and the composed B=1 router keep their ids in registers)
    record_routes: bool = False
    async_scheduling: str = "auto"  # on | off | auto (on for CUDA): host work of step t+1 overlaps step t
    decode_steps: int = 0  # decode steps per host round trip (multi-step decode); 0 = auto: 8 on CUDA, else 1
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)

    def val_sampling(self) -> ValKwargs:
        """The validation's sampling: `val_kwargs` with each None replaced by the training rollout's value."""
        v = self.val_kwargs
        return ValKwargs(**{f.name: getattr(self if getattr(v, f.name) is None else v, f.name)
                            for f in fields(ValKwargs)})

    @property
    def generates_ahead(self) -> bool:
        """Whether the next step's batch is generated while this one trains (the RL loop's `RolloutAhead`)."""
        return self.mode == "async" or (self.mode == "disaggregated" and self.max_staleness >= 1)

    def check(self) -> None:
        _require(self.n >= 1, "rollout.n", "must be >= 1")
        _check_sampling(self, "rollout")
        _require(self.mode in ("colocated", "disaggregated", "async"), "rollout.mode", "must be colocated|disaggregated|async")
        _require(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", "must be in (0, 1)")
        _require(self.block_size > 0, "rollout.block_size", "must be > 0")
        _require(self.max_num_seqs > 0, "rollout.max_num_seqs", "must be > 0")
        _require(self.max_num_batched_tokens > 0, "rollout.max_num_batched_tokens", "must be > 0")
        _require(self.max_model_len > 0, "rollout.max_model_len", "must be > 0")
        _require(self.async_scheduling in ("on", "off", "auto"), "rollout.async_scheduling", "must be on|off|auto")
        _require(self.decode_steps >= 0, "rollout.decode_steps", "must be >= 0 (0 = auto)")
        _require(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
        _require(self.threads >= 0, "rollout.threads", "must be >= 0 (0 = the trainer's)")
        _require(self.kv_cache_bytes >= 0, "rollout.kv_cache_bytes", "must be >= 0 (0 = rollout.gpu_memory_utilization)")
        _check_sampling(self.val_sampling(), "rollout.val_kwargs")
        _require(self.device == "" or self.device == "cpu" or self.device.startswith("cuda"), "rollout.device",
                 f"must be empty (auto), cpu, cuda or cuda:N, got {self.device!r}")
        self.multi_turn.check()


@dataclass
class RewardServerSection:
    url: str = ""  # remote reward service for reward.fn=http, e.g. http://10.0.0.5:8011
    token: str = ""  # bearer token; also read from $MOELOOP_REWARD_TOKEN when empty
    serve_fn: str = ""  # non-empty: start `moeloop reward serve --fn serve_fn` locally under a supervisor
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (kept across restarts)
    health_interval_s: float = 0.5
    startup_timeout_s: float = 60.0
    max_restarts: int = 5

    def check(self) -> None:
        _require(self.port >= 0, "reward.server.port", "must be >= 0")
        _require(self.health_interval_s > 0, "reward.server.health_interval_s", "must be > 0")
        _require(self.startup_timeout_s > 0, "reward.server.startup_timeout_s", "must be > 0")
        _require(self.max_restarts >= 0, "reward.server.max_restarts", "must be >= 0")


@dataclass
class RewardSection:
    fn: str = "arith"  # built-in (math|format|arith|code|http|reward_model) or dotted path "pkg.module.fn"
    concurrency: int = 8
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.1
    fallback: str = "mask"  # mask | neutral | fail
    neutral_score: float = 0.0
    executor: str = "thread"  # thread | process : where sync reward functions run
    breaker_failures: int = 10  # consecutive failures that open the circuit breaker; 0 = off
    breaker_reset_s: float = 5.0  # how long it stays open before one probe call
    fn_options: dict[str, Any] = field(default_factory=dict)  # passed to a built-in's factory, e.g. code: {sandbox: {cpu_s: 2}}
    # several functions, the reward their weighted sum (replaces fn): [{fn, weight, options, name}] (reward.composite)
    fns: list[Any] = field(default_factory=list)
    server: RewardServerSection = field(default_factory=RewardServerSection)

    def check(self) -> None:
        _require(self.fallback in ("mask", "neutral", "fail"), "reward.fallback", "must be mask|neutral|fail")
        _require(self.concurrency >= 1, "reward.concurrency", "must be >= 1")
        _require(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _require(self.retries >= 0, "reward.retries", "must be >= 0")
        _require(self.backoff_s >= 0, "reward.backoff_s", "must be >= 0")
        _require(self.executor in ("thread", "process"), "reward.executor", "must be thread|process")
        _require(self.breaker_failures >= 0, "reward.breaker_failures", "must be >= 0")
        _require(self.breaker_reset_s > 0, "reward.breaker_reset_s", "must be > 0")
        _require(self.fn != "http" or bool(self.server.url or self.server.serve_fn), "reward.server.url",
                 "must be set (or reward.server.serve_fn) when reward.fn=http")
        self.server.check()


@dataclass
class AlgorithmSection:
    # grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae | remax (each prompt also gets a greedy response,
    # whose reward is its samples' baseline; ReMax, verl's remax)
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # False = Dr.GRPO
    adv_std_scope: str = "group"  # grpo's std: group | batch (every score of the step's batch; TRL's scale_rewards)
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001  # the in-reward KL coefficient (the starting value when adaptive)
    kl_penalty: str = "k1"
    kl_ctrl: str = "fixed"  # fixed | adaptive: move kl_coef to hold the in-reward KL near kl_target (algo/kl_control.py)
    kl_target: float = 0.1  # adaptive: the mean per-token KL aimed at
    kl_horizon: int = 10000  # adaptive: samples over which a full proportional correction applies
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refill_rounds: int = 4
    overlong_penalty: bool = False
    overlong_buffer_len: int = 16
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False  # DAPO overlong filtering: responses cut at the length limit leave the loss

    def check(self) -> None:
        ests = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "remax")
        _require(self.adv_estimator in ests, "algorithm.adv_estimator", f"must be one of {'|'.join(ests)}")
        _require(self.adv_std_scope in ("group", "batch"), "algorithm.adv_std_scope", "must be group|batch")
        _require(self.kl_penalty in ("k1", "k2", "k3", "low_var_kl"), "algorithm.kl_penalty", "must be k1|k2|k3|low_var_kl")
        _require(self.kl_ctrl in ("fixed", "adaptive"), "algorithm.kl_ctrl", "must be fixed|adaptive")
        _require(self.kl_target > 0, "algorithm.kl_target", "must be > 0")
        _require(self.kl_horizon > 0, "algorithm.kl_horizon", "must be > 0")
        for name in ("gamma", "lam"):
            _require(0 <= getattr(self, name) <= 1, f"algorithm.{name}", "must be in [0, 1]")
        _require(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        _require(self.max_refill_rounds >= 0, "algorithm.max_refill_rounds", "must be >= 0")
        _require(self.overlong_penalty_factor >= 0, "algorithm.overlong_penalty_factor", "must be >= 0")


@dataclass
class OptimSection:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0  # 1.0 = constant after warmup; < 1 = cosine decay to lr*min_lr_ratio

    def check(self, prefix: str) -> None:
        _require(self.lr >= 0, f"{prefix}.optim.lr", "must be >= 0")
        _require(self.weight_decay >= 0, f"{prefix}.optim.weight_decay", "must be >= 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{prefix}.optim.betas",
                 f"must be two values in [0, 1), got {list(self.betas)}")
        _require(self.eps > 0, f"{prefix}.optim.eps", "must be > 0")
        _require(self.warmup_steps >= 0, f"{prefix}.optim.warmup_steps", "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, f"{prefix}.optim.min_lr_ratio", "must be in [0, 1] (1 = constant)")


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
    # ppo (clip-higher, dual-clip) | gspo (sequence ratio) | cispo (MiniMax-M1: the IS weight clipped to
    # [1 - clip_ratio_low, 1 + clip_ratio_high] and held fixed; clip_ratio_low 1 = no lower bound, the paper's)
    # | sapo (a soft sigmoid gate of the ratio instead of a hard clip, temperatures sapo_tau_pos / sapo_tau_neg)
    policy_loss: str = "ppo"
    sapo_tau_pos: float = 1.0  # sapo: gate temperature for tokens with a positive advantage (TRL's default)
    sapo_tau_neg: float = 1.05  # ... and for the rest
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # > 0: every this-many steps the reference policy moves toward the actor, ref = alpha * actor + (1 - alpha) * ref
    # (TRL's sync_ref_model with ref_model_sync_steps / ref_model_mixup_alpha; alpha 1 = ProRL's reference reset)
    ref_sync_steps: int = 0
    ref_sync_alpha: float = 1.0
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    recompute_old_logprobs: bool = True  # False = bypass: take old logprobs from the rollout
    force_old_logprob_pass: bool = False  # recompute even when the update is exactly on-policy
    # > 0: truncated importance sampling for the rollout/trainer mismatch: each token's policy loss times
    # min(pi_old / pi_rollout, tis_cap), pi_old the trainer's old logprob, pi_rollout the engine's (verl's
    # tis_imp_ratio_cap, TRL's vllm_importance_sampling_cap); 0 = off
    tis_cap: float = 0.0
    # token_truncate (above) | token_mask (tokens whose weight is outside [tis_floor, tis_cap] leave the loss, the
    # rest keep their weight) | sequence_truncate / sequence_mask (one weight a sequence: the product of its tokens'
    # ratios); TRL's vllm_importance_sampling_mode
    tis_mode: str = "token_truncate"
    tis_floor: float = 0.0  # lower bound of the weight (truncate: clamped up to it; mask: below it = masked)
    # off-policy sequence masking (DeepSeek-V3.2; TRL's off_policy_mask_threshold): a sequence with a negative
    # advantage whose mean per-token KL(sampling policy || current policy) exceeds this leaves the policy loss;
    # the sampling policy is the rollout's logprobs when present, else the old ones. None = off
    off_policy_mask_threshold: Optional[float] = None
    # router replay (moeloop.model.routes): off | R2 (the old-logprob pass records each token's experts, the update
    # replays them) | R3 (the rollout engine records them, the old-logprob pass and the update replay them)
    router_replay: str = "off"
    # < 1: only this top fraction of a mini-batch's loss tokens by entropy (the old policy's, over every DP rank)
    # takes part in the policy-gradient term (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's
    # top_entropy_quantile); the KL and entropy terms keep every token, the denominators are unchanged
    top_entropy_quantile: float = 1.0
    # the update leaves out (no forward, no backward) each sample that cannot move the weights: one with no loss
    # token, or, when the loss has no KL or entropy term, one whose loss tokens' advantages are all 0 (a GRPO group
    # whose rewards are all equal). Exact: every policy loss is the advantage times a function of the ratio, so their
    # gradient is 0, and the loss normalisers still count them. The update's token metrics (entropy, ppo_kl, clip
    # fractions, num_loss_tokens) then cover the samples it trained on; skipped_samples_frac says how many it left out
    skip_zero_advantage: bool = True
    offload: OffloadSection = field(default_factory=OffloadSection)
    # LoRA (verl's lora_rank / lora_alpha / target_modules, TRL's peft_config): > 0 trains rank-r adapters on the
    # target modules of the decoder layers, y = x W^T + (alpha / r) (x A^T) B^T, the base weights frozen, the adapters
    # in fp32 whatever model.dtype (peft's default), A drawn from trainer.seed (moeloop.train.lora). 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 16.0  # verl's default; the adapter's output is scaled by lora_alpha / lora_rank
    # module names: a module is targeted when its name ends with an entry ("q_proj" targets every layer's q_proj,
    # "mlp.down_proj" the dense layers' down_proj only). all-linear (verl's default): every nn.Linear of the decoder
    # layers: attention (q/k/v/o_proj; MLA's q_a/q_b/kv_a/kv_b/o_proj), dense MLPs and shared experts
    # (gate/up/down_proj); never lm_head or the router. experts (or mlp.experts): the routed experts, one adapter per
    # expert on gate_up_proj and on down_proj (stacked [E, ...]; exported as each expert's gate/up/down_proj).
    # all-linear does not include the routed experts (as peft's all-linear on transformers 5, whose experts are stacked
    # parameters; on transformers 4's per-expert nn.Linear it would): they hold most of an MoE's parameters, and an
    # adapter per expert multiplies the adapter count by E. Both: [all-linear, experts]
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    lora_dropout: float = 0.0  # only 0: in-train dropout makes the update's logprobs differ from the old/rollout ones

    def check(self, prefix: str = "actor") -> None:
        modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
        _require(self.loss_agg_mode in modes, f"{prefix}.loss_agg_mode", f"must be one of {'|'.join(modes)}")
        losses = ("ppo", "gspo", "cispo", "sapo")
        _require(self.policy_loss in losses, f"{prefix}.policy_loss", f"must be one of {'|'.join(losses)}")
        _require(self.sapo_tau_pos > 0, f"{prefix}.sapo_tau_pos", "must be > 0")
        _require(self.sapo_tau_neg > 0, f"{prefix}.sapo_tau_neg", "must be > 0")
        _require(self.router_replay in ("off", "R2", "R3"), f"{prefix}.router_replay", "must be off|R2|R3")
        _require(self.ref_sync_steps >= 0, f"{prefix}.ref_sync_steps", "must be >= 0 (0 = off)")
        _require(0 < self.ref_sync_alpha <= 1, f"{prefix}.ref_sync_alpha", "must be in (0, 1]")
        _require(0 < self.top_entropy_quantile <= 1, f"{prefix}.top_entropy_quantile", "must be in (0, 1] (1 = off)")
        tis_modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
        _require(self.tis_mode in tis_modes, f"{prefix}.tis_mode", f"must be one of {'|'.join(tis_modes)}")
        _require(self.tis_floor >= 0, f"{prefix}.tis_floor", "must be >= 0")
        _require(not self.tis_cap or self.tis_floor < self.tis_cap, f"{prefix}.tis_floor",
                 f"must be below {prefix}.tis_cap ({self.tis_cap})")
        _require(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
                 f"{prefix}.off_policy_mask_threshold", "must be >= 0 (or null = off)")
        _require(self.kl_loss_type in ("k1", "k2", "k3", "low_var_kl"), f"{prefix}.kl_loss_type", "must be k1|k2|k3|low_var_kl")
        _require(self.ppo_epochs >= 1, f"{prefix}.ppo_epochs", "must be >= 1")
        _require(self.max_tokens_per_micro_batch > 0, f"{prefix}.max_tokens_per_micro_batch", "must be > 0")
        _require(self.clip_ratio_c > 1.0, f"{prefix}.clip_ratio_c", "must be > 1 (dual-clip bound)")
        _require(self.tis_cap >= 0, f"{prefix}.tis_cap", "must be >= 0 (0 = off)")
        _require(self.ppo_mini_batch_size >= 1, f"{prefix}.ppo_mini_batch_size", "must be >= 1")
        _require(0 <= self.clip_ratio_low <= 1, f"{prefix}.clip_ratio_low", "must be in [0, 1]")
        _require(self.clip_ratio_high >= 0, f"{prefix}.clip_ratio_high", "must be >= 0")
        _require(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0 (0 = no clipping)")
        _require(self.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef", "must be >= 0")
        self.optim.check(prefix)
        self.check_lora(prefix)

    def check_lora(self, prefix: str) -> None:
        _require(self.lora_rank >= 0, f"{prefix}.lora_rank", "must be >= 0 (0 = full fine-tuning)")
        _require(self.lora_alpha > 0, f"{prefix}.lora_alpha", "must be > 0")
        _require(self.lora_dropout == 0, f"{prefix}.lora_dropout",
                 "must be 0 (dropout in the adapter would make the update's logprobs differ from the old ones)")
        targets = list(self.lora_target_modules)
        _require(bool(targets) and all(isinstance(t, str) and t.strip() for t in targets),
                 f"{prefix}.lora_target_modules", f"must list module names or all-linear, got {targets}")
        _require("all-linear" not in targets or all(t == "all-linear" or _names_experts(t) for t in targets),
                 f"{prefix}.lora_target_modules",
                 f"all-linear stands alone or with experts (it targets every linear module), got {targets}")

    def lora_targets(self, names: list[str], expert_names: Collection[str] = (), prefix: str = "actor") -> list[str]:
        """The names among `names` (a model's candidate modules in model order: its nn.Linear modules and routed
        experts, `expert_names` being the latter) that `lora_target_modules` targets, in their order; an entry that
        matches none raises, naming the field and listing the candidates."""
        entries = list(self.lora_target_modules)
        for entry in entries:
            if entry != "all-linear" and not any(_names_module(name, entry) for name in names):
                leaves = sorted({name.split(".layers.")[-1].split(".", 1)[-1] for name in names})
                raise InputError(f"{prefix}.lora_target_modules: {entry!r} matches no module LoRA can target; the "
                                 f"model's are (in every layer that has them) {', '.join(leaves)}, or all-linear")
        every_linear = "all-linear" in entries
        return [name for name in names if (every_linear and name not in expert_names)
                or any(_names_module(name, entry) for entry in entries)]


def _names_experts(entry: str) -> bool:
    """Whether a lora_target_modules entry names the routed experts (experts, mlp.experts)."""
    return entry == "experts" or entry.endswith(".experts")


def _names_module(name: str, entry: str) -> bool:
    """Whether module `name` is the one `entry` names: equal, or ending with it after a dot (peft's rule)."""
    return name == entry or name.endswith("." + entry)


@dataclass
class CriticSection(ActorSection):
    enable: bool = False
    cliprange_value: float = 0.5

    def check(self, prefix: str = "critic") -> None:
        super().check(prefix)
        _require(self.cliprange_value > 0, f"{prefix}.cliprange_value", "must be > 0")
        _require(self.lora_rank == 0, f"{prefix}.lora_rank", "must be 0: LoRA trains the actor (the critic trains in full)")


@dataclass
class ParallelSection:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    first_stage_layers: int = 0  # uneven pipeline: decoder layers on the first stage (0 = even split)
    last_stage_layers: int = 0  # ... and on the last stage (Megatron num_layers_in_last_pipeline_stage)
    rollout_tp: int = 0  # `moeloop plan`: GPUs one rollout engine spans (another engine's layout); 0 = 1, moeloop's
    sequence_parallel: bool = False  # under tp: the residual stream and norms split by rows (Megatron's)

    def check(self) -> None:
        for name in ("dp", "tp", "pp", "vpp", "ep", "etp", "cp"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1")
        for name in ("first_stage_layers", "last_stage_layers", "rollout_tp"):
            _require(getattr(self, name) >= 0, f"parallel.{name}", "must be >= 0")
        for name in ("cp", "pp"):  # (as `parallel.groups.check_sequence_parallel` at run time)
            _require(not self.sequence_parallel or getattr(self, name) == 1, "parallel.sequence_parallel",
                     f"true with parallel.{name}={getattr(self, name)} is not supported (set parallel.{name}=1 or "
                     "parallel.sequence_parallel=false)")


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
    save_final: bool = True  # DCP checkpoint after the last step
    export_hf_final: bool = True  # HF export (re-loaded and compared) after the last step
    resume_from: str = ""  # a step_N checkpoint to resume from, as --resume does from the newest (verl's resume_path)

    def check(self) -> None:
        _require(self.save_every >= 0, "checkpoint.save_every", "must be >= 0 (0 = only at the end)")
        _require(self.export_hf_every >= 0, "checkpoint.export_hf_every", "must be >= 0 (0 = only at the end)")
        _require(self.keep >= 1, "checkpoint.keep", "must be >= 1 (the newest checkpoint is what --resume loads)")


@dataclass
class TrainerSection:
    steps: int = 10
    epochs: int = 0  # > 0: passes over data.train_files instead of trainer.steps (SFT and RL; loop.env.training_steps)
    val_every: int = 0
    val_before_train: bool = True  # validate at step 0 too (verl's name); a run of trainer.steps=0 always does
    val_samples: int = 4  # samples per held-out prompt for the sampled accuracy (0 = greedy only)
    log: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    run_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    critic_warmup: int = 0  # PPO: the first this-many steps train only the critic (verl's trainer.critic_warmup)
    log_val_generations: int = 0  # the first N held-out generations of each validation -> <run_dir>/val_generations.jsonl
    rollout_data_dir: str = ""  # non-empty: each RL step's samples (prompt, response, score...) -> <dir>/<step>.jsonl
    project_name: str = "moeloop"  # the W&B project
    experiment_name: str = ""  # the W&B run name ("" = run_dir's folder name)

    def check(self) -> None:
        for name in ("steps", "epochs", "val_every", "val_samples", "log_val_generations"):
            _require(getattr(self, name) >= 0, f"trainer.{name}", "must be >= 0")
        _require(self.device in ("auto", "cpu", "cuda"), "trainer.device", f"must be auto|cpu|cuda, got {self.device!r}")
        sinks = ("console", "jsonl", "tensorboard", "wandb")
        _require(set(self.log) <= set(sinks), "trainer.log", f"must list sinks from {'|'.join(sinks)}, got {list(self.log)}")


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
    mtbf_hours: float = 24.0  # mean time between failures of the whole job (any rank), for Young/Daly

    def check(self) -> None:
        _require(self.gpus_per_node >= 1, "hardware.gpus_per_node", "must be >= 1")
        for name in ("gpu_memory_gb", "hbm_gbps", "pcie_gbps", "nvlink_gbps", "network_gbps", "disk_gbps", "peak_tflops",
                     "cpu_memory_gb_per_node", "mtbf_hours"):
            _require(getattr(self, name) > 0, f"hardware.{name}", "must be > 0")


@dataclass
class PlanSection:
    """Planner-only inputs (`moeloop plan`): what the run config does not already say. GB = 1e9 bytes."""

    total_gpus: int = 0  # pool shared by training and rollout; 0 = the training world dp*tp*pp*cp
    hf_config: dict[str, Any] = field(default_factory=dict)  # inline config.json; empty = read model.path
    # parameter counts instead of a model config (a published figure with no config.json); 0 = from the model
    dense_params: float = 0.0
    expert_params: float = 0.0
    active_params: float = 0.0
    # state bytes per parameter; 0 = torch AdamW in model.dtype (weights = grads = dtype, optimizer = 2 x dtype)
    weight_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0  # e.g. 12 = fp32 master + Adam m + v (Megatron distributed optimizer)
    sharding: str = "fsdp"  # fsdp (params, grads, optimizer over DP) | optimizer (optimizer only) | none
    cpu_optimizer_step: bool = False  # optimizer states never on GPU: the step runs on CPU (Megatron optimizer_cpu_offload)
    num_micro_batches: int = 0  # per mini-batch per DP rank; 0 = from the token budget
    avg_prompt_tokens: int = 0  # 0 = data.max_prompt_length
    avg_response_tokens: int = 0  # 0 = data.max_response_length
    logits: str = "chunked"  # chunked (model.logprob_chunk_tokens at a time) | naive (whole micro-batch)
    comm_bucket_mb: float = 256.0  # gradient reduce / parameter all-gather bucket in flight
    reserve_gb: float = 0.0  # CUDA context, NCCL, allocator slack: outside torch.cuda.max_memory_allocated
    given_gb: dict[str, float] = field(default_factory=dict)  # replace computed ledger entries (see moeloop.plan.memory)
    tight_fraction: float = 0.9  # peak above this fraction of GPU memory is "tight"
    # step-time model
    mfu: float = 0.3
    decode_efficiency: float = 0.5  # fraction of the HBM roofline the rollout engine reaches
    reward_s_per_sample: float = 0.0
    checkpoint_save_s: float = 0.0  # 0 = state bytes / (disk_gbps * nodes)
    # multi-turn tool calling (rollout.multi_turn on): calls a sample makes (0 = max_turns - 1, a call every turn but
    # the last), seconds a call takes (0 = not counted), tool-turn tokens a sample holds (0 = calls x
    # max_tool_response_tokens, within the response)
    tool_calls_per_sample: float = 0.0
    tool_s_per_call: float = 0.0
    avg_tool_tokens: int = 0

    def check(self) -> None:
        _require(self.sharding in ("fsdp", "optimizer", "none"), "plan.sharding", "must be fsdp|optimizer|none")
        _require(self.logits in ("chunked", "naive"), "plan.logits", "must be chunked|naive")
        _require(0 < self.mfu <= 1, "plan.mfu", "must be in (0, 1]")
        _require(0 < self.decode_efficiency <= 1, "plan.decode_efficiency", "must be in (0, 1]")
        _require(0 < self.tight_fraction <= 1, "plan.tight_fraction", "must be in (0, 1]")
        for name in ("weight_bytes", "grad_bytes", "optimizer_bytes", "total_gpus", "num_micro_batches", "dense_params",
                     "expert_params", "active_params", "avg_prompt_tokens", "avg_response_tokens", "comm_bucket_mb",
                     "reserve_gb", "reward_s_per_sample", "checkpoint_save_s", "tool_calls_per_sample",
                     "tool_s_per_call", "avg_tool_tokens"):
            _require(getattr(self, name) >= 0, f"plan.{name}", "must be >= 0")


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
    plan: PlanSection = field(default_factory=PlanSection)

    def old_logprobs_from_rollout(self, off_policy: bool) -> bool:
        """The update's old logprobs are the rollout engine's: bypass, and always for an `off_policy` batch (the
        policy that sampled it is the old one)."""
        return not self.actor.recompute_old_logprobs or off_policy

    def old_logprob_pass(self, off_policy: bool) -> bool:
        """Whether the RL loop's old-logprob pass runs (`loop.rl.fill_old_logprobs`; the planner times it): to
        recompute the old logprobs unless the update is exactly on-policy (one epoch, one mini-batch, no KL in the
        reward: its own detached logprobs are the same gradient), and always for the top-entropy selection's
        entropies."""
        a = self.actor
        on_policy = (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.data.train_batch_size
                     and not self.algorithm.use_kl_in_reward and not a.force_old_logprob_pass)
        return a.top_entropy_quantile < 1 or not (self.old_logprobs_from_rollout(off_policy) or on_policy)
