"""`Components`: everything one RL run holds — built once from the config, saved and resumed as one.

`build_components(cfg, resume)` makes the tokenizer, datasets and cursor, the actor (and a frozen
reference when a KL term needs it; under LoRA the actor with its adapters off), the rollout engine (colocated:
sharing the actor's parameters in process, under LoRA all but the adapted weights, which get the merged ones;
async: its own copy in process; disaggregated: a process of its own, `RemoteEngine`),
the reward pool, the weight syncer, checkpoints and the logger, and restores them from the latest
checkpoint on `--resume`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeloop.algo.kl_control import KLController
from moeloop.checkpoint import CheckpointManager
from moeloop.config import RunConfig
from moeloop.data import EpochCursor, PromptDataset, load_rows
from moeloop.data.dataset import Example
from moeloop.errors import InputError
from moeloop.loop.env import (RunEnv, check_parallel_support, dtype_of, load_policy, load_tokenizer, resume_from,
                              training_steps, write_run_config)
from moeloop.loop.dump import gather_records, sample_record, write_jsonl
from moeloop.loop.export import export_policy
from moeloop.loop.generation import RolloutWorker
from moeloop.loop.metrics import MetricsLogger
from moeloop.loop.remote_rollout import RemoteEngine, rollout_device, rollout_threads
from moeloop.loop.tools import prompt_tools
from moeloop.loop.sft import actor_state_load, actor_state_save
from moeloop.model.hf_io import load_pretrained
from moeloop.parallel.collectives import global_values
from moeloop.plan import predict_peak_bytes
from moeloop.reward import RewardPool
from moeloop.reward.composite import component_specs
from moeloop.reward.registry import BUILTIN_REWARDS, GROUND_TRUTH_REWARDS, check_options, import_by_path
from moeloop.rollout import Engine
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.sync import (DiskTransport, InProcessTransport, ProcessTransport, Transport, WeightSyncer,
                           drain_before_step, share_parameters)
from moeloop.train.actor import Actor, PolicyForward
from moeloop.train.critic import Critic
from moeloop.train.host_memory import retain_freed_host_memory
from moeloop.train.lora import AdapterOffReference, adapted_weights


@dataclass
class Components:
    cfg: RunConfig
    env: RunEnv
    tokenizer: Any
    train: PromptDataset
    val: PromptDataset | None
    cursor: EpochCursor
    actor: Actor
    ref: PolicyForward | AdapterOffReference | None
    critic: Critic | None
    engine: Any
    rollout: RolloutWorker
    rewards: RewardPool
    syncer: WeightSyncer
    ckpt: CheckpointManager
    logger: MetricsLogger
    kl_ctrl: KLController  # the in-reward KL coefficient (fixed or adaptive); run state, checkpointed
    start_step: int = 0
    groups_issued: int = field(default=0)
    planned_peak_bytes: int = 0  # the planner's prediction for this run (CUDA only), logged beside the measured peak

    @property
    def prompts_per_rank(self) -> int:
        return self.cfg.data.train_batch_size // self.env.world_size

    def next_prompts(self, count: int) -> tuple[list[Example], list[int]]:
        """This rank's share of the next `count * world_size` prompts and their global positions.

        Every global mini-batch (ppo_mini_batch_size consecutive prompts) is split evenly over the
        ranks, so each optimizer step sees the same prompts whatever the number of ranks."""
        world = self.env.world_size
        indices = self.cursor.take(count * world)
        per_mini = max(1, min(self.cfg.actor.ppo_mini_batch_size, count * world) // world)
        positions = [p for p in range(count * world) if (p // per_mini) % world == self.env.rank]
        return [self.train[indices[p]] for p in positions], positions

    def next_group_base(self, count: int) -> int:
        base = self.env.rank * 1_000_000_000 + self.groups_issued
        self.groups_issued += count
        return base

    def train_params(self, step: int, round_idx: int, positions: list[int]) -> list[SamplingParams]:
        """One seed per prompt from (run seed, step, refill round, global prompt position): the samples do
        not depend on how prompts are spread over DP ranks, so N ranks generate what one rank would."""
        r = self.cfg.rollout
        return [self.rollout.params(r.n, r.temperature, r.top_p, r.top_k, _seed(self.cfg.trainer.seed, step, round_idx, p),
                                    ignore_eos=r.ignore_eos, repetition_penalty=r.repetition_penalty, min_p=r.min_p)
                for p in positions]

    def greedy_params(self, repetition_penalty: float) -> SamplingParams:
        """One greedy response a prompt (the greedy validation, ReMax's baselines): the repetition penalty applies to
        greedy decoding too (as in transformers and vLLM); min-p does not."""
        return self.rollout.params(1, 0.0, repetition_penalty=repetition_penalty)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy over the held-out rows (the first `data.val_max_samples`), `data.val_batch_size`
        prompts a generate call (a sample is correct when its reward is >= 1): greedy, and the mean over
        `trainer.val_samples` samples per prompt (at `rollout.val_kwargs`, by default the training rollout's
        sampling: the policy RL optimises) with the
        fraction of prompts that any of them solves (`acc/val_pass@k`, verl's best@k); with several data sources
        also each source's (`acc/val/<source>`, as verl logs per data source). With `trainer.log_val_generations`
        = N, the first N generations (by row, then sample; the sampled ones when there are) go to
        val_generations.jsonl, tagged with `step`."""
        if self.val is None:
            return {}
        n = len(self.val)
        sources = sorted({self.val[i].data_source for i in range(n)})  # the same list on every rank
        v, k = self.cfg.rollout.val_sampling(), self.cfg.trainer.val_samples
        records: list[dict[str, Any]] = []
        out = self._accuracy(n, self.greedy_params(v.repetition_penalty), sources, "acc/val",
                             records=records if k == 0 else None)
        if k > 0:
            sampled = self.rollout.params(k, v.temperature, v.top_p, v.top_k, seed=self.cfg.trainer.seed,
                                          repetition_penalty=v.repetition_penalty, min_p=v.min_p)
            out.update(self._accuracy(n, sampled, sources, "acc/val_sampled", f"acc/val_pass@{k}", records))
        if self.cfg.trainer.log_val_generations:
            first = sorted(gather_records(records, every_rank=True), key=lambda rec: (rec["index"], rec["sample_index"]))
            if self.env.is_main:
                write_jsonl(self.env.run_dir / "val_generations.jsonl",
                            [dict(rec, step=step) for rec in first[:self.cfg.trainer.log_val_generations]], append=True)
        return out

    def _accuracy(self, num_prompts: int, params: SamplingParams, sources: list[str], key: str,
                  pass_key: str = "", records: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """`key`: the fraction of correct samples; `key` with reward/ for acc/: their mean reward (a reward model's
        scores say more than its >= 1 count); `pass_key` (when given): the fraction of prompts with a correct sample.
        `records`: each sample's `sample_record` (with its held-out row `index`) is appended there."""
        row = {source: i for i, source in enumerate(sources)}
        # correct, samples, solved, prompts, reward sum; per source, then all
        tallies = [[0.0] * (len(sources) + 1) for _ in range(5)]
        step, rank, world = self.cfg.data.val_batch_size, self.env.rank, self.env.world_size
        for start in range(0, num_prompts, step):  # each rank generates its share of each chunk
            rows = range(start + rank, min(start + step, num_prompts), world)
            share = [self.val[i] for i in rows]
            # each held-out row draws with its own seed (one seed for all made sample i of every prompt share its noise)
            each = [replace(params, seed=_seed(params.seed, i)) for i in rows] if params.seed is not None else params
            samples = self.rollout.generate(share, each, 0) if share else []
            self.rewards.score(samples)
            if records is not None:
                records += [sample_record(s, 0, index=rows[s.group_id]) for s in samples]
            solved: dict[int, bool] = {}
            for s in samples:
                solved[s.group_id] = solved.get(s.group_id, False) or s.reward >= 1.0
                for i in (row[s.data_source], len(sources)):
                    tallies[0][i] += s.reward >= 1.0
                    tallies[1][i] += 1
                    tallies[4][i] += s.reward
            for group, ok in solved.items():
                for i in (row[share[group].data_source], len(sources)):
                    tallies[2][i] += ok
                    tallies[3][i] += 1
        totals = global_values([v for tally in tallies for v in tally], every_rank=True)  # (each rank's share)
        width = len(sources) + 1
        correct, seen, solved_n, prompts, reward_sum = (totals[j * width:(j + 1) * width] for j in range(5))
        out: dict[str, float] = {}
        named = [(key, correct, seen), (key.replace("acc/", "reward/"), reward_sum, seen)]
        for name, hits, count in named + ([(pass_key, solved_n, prompts)] if pass_key else []):
            acc = [h / max(c, 1.0) for h, c in zip(hits, count)]
            out[name] = acc[-1]
            if len(sources) > 1:
                out.update({f"{name}/{source}": acc[i] for i, source in enumerate(sources)})
        return out

    def saves_at(self, step: int) -> bool:
        """Whether `maybe_save(step)` writes a checkpoint."""
        every, last = self.cfg.checkpoint.save_every, step == self.cfg.trainer.steps
        return bool((every and step % every == 0) or (last and self.cfg.checkpoint.save_final))

    def maybe_save(self, step: int) -> None:
        last = step == self.cfg.trainer.steps
        if self.saves_at(step):
            actor_state_save(self.ckpt, step, self.actor, self.cursor, version=step, world_size=self.env.world_size,
                             kl_ctrl=self.kl_ctrl.state_dict())
            if self.critic is not None:
                self.critic_ckpt.save(step, self.critic.model, self.critic.optimizer, {"step": step})
            if self.ref is not None and self.cfg.actor.ref_sync_steps:  # the reference moves: it is state too
                self.beside_ckpt("ref").save(step, self.ref.model, None, {"step": step})
        hf_every = self.cfg.checkpoint.export_hf_every
        if (hf_every and step % hf_every == 0) or (last and self.cfg.checkpoint.export_hf_final):
            export_policy(self.actor, self.env.run_dir, self.cfg.model.path, write=self.env.is_main)

    @property
    def critic_ckpt(self) -> CheckpointManager:
        return self.beside_ckpt("critic")

    def beside_ckpt(self, name: str) -> CheckpointManager:
        """The checkpoints of another model saved with the actor's (<dir>/<name>/step_N)."""
        return CheckpointManager(self.ckpt.directory / name, self.ckpt.keep)

    def finish(self) -> None:
        self.logger.close()
        self.rewards.close()
        self.rollout.close()
        if isinstance(self.engine, RemoteEngine):
            self.engine.close()


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def build_engine(cfg: RunConfig, model: torch.nn.Module, tokenizer: Any) -> Engine:
    """The colocated engine on its own copy of the weights, sized for prompt + response."""
    rollout_cfg = replace(cfg.rollout, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                          record_routes=cfg.rollout.record_routes or cfg.actor.router_replay == "R3")
    return Engine(model, rollout_cfg, eos_token_ids=[tokenizer.eos_token_id], seed=cfg.trainer.seed,
                  detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def engine_model(cfg: RunConfig, env: RunEnv, actor: Actor) -> torch.nn.Module:
    """The engine's model; colocated in process, its parameters alias the actor's where device and dtype match
    (async rollout keeps its own copy: it generates while the actor's weights change). Under LoRA the adapted
    weights (with expert adapters, the routed experts' too) keep their own copy, which each push fills with the merged
    W + scale * B @ A; the rest (the frozen embedding, norms, router, unadapted experts) is aliased: it never changes."""
    model = load_pretrained(cfg.model.path, dtype=dtype_of(cfg.model.dtype), device=env.device)
    if shares_weights(cfg):
        share_parameters(actor.model, model, skip=set(adapted_weights(actor.model)))
    return model


def shares_weights(cfg: RunConfig) -> bool:
    return cfg.sync.transport == "inprocess" and cfg.rollout.mode == "colocated"


def _colocated_transport(cfg: RunConfig, env: RunEnv) -> Transport:
    if cfg.sync.transport == "disk":  # the fallback path, exercised end to end through safetensors files
        return DiskTransport(env.run_dir / "sync" / f"rank{env.rank}")
    return InProcessTransport(env.device)


def check_runtime_support(cfg: RunConfig) -> None:
    """Settings the planner understands but the runtime does not run yet fail here, by name."""
    if cfg.sync.transport == "broadcast":
        raise InputError("sync.transport=broadcast (to engines on other nodes) is not run by the RL loop yet: "
                         "rollout.mode=disaggregated runs each rank's engine on this node and sends it the weights "
                         "through its pipe")
    if cfg.rollout.mode == "disaggregated" and cfg.sync.transport != "inprocess":
        raise InputError(f"sync.transport={cfg.sync.transport} with rollout.mode=disaggregated: the weights go through "
                         f"the engine process's pipe (leave sync.transport at inprocess)")
    if cfg.rollout.mode == "async" and cfg.rollout.max_staleness < 1:
        raise InputError("rollout.max_staleness must be >= 1 with rollout.mode=async (the next batch is generated "
                         "with the weights of before this step's update: samples are 1 version old)")
    if cfg.rollout.generates_ahead and cfg.algorithm.dynamic_sampling:
        raise InputError(f"algorithm.dynamic_sampling is not supported with rollout.mode={cfg.rollout.mode} and "
                         f"rollout.max_staleness >= 1 (its refill rounds gather across ranks, which the rollout thread "
                         f"must not do)")
    if cfg.parallel.rollout_tp > 1:
        raise InputError(f"parallel.rollout_tp={cfg.parallel.rollout_tp}: moeloop's rollout engine holds the whole "
                         "model on each rank (no engine tensor parallelism yet); rollout_tp plans another engine's "
                         "layout in `moeloop plan` only (leave it at 0 for a run)")
    check_parallel_support(cfg)


def check_reward_config(cfg: RunConfig) -> None:
    """reward.fns' entries, a built-in's options and the dotted paths of reward.fn / reward.fns: a mistake is an
    InputError before the run writes its files (it came after config.yaml). A reward service's function
    (reward.server.serve_fn) is its own process's to import."""
    specs = [(fn, options) for _, fn, _, options in component_specs(cfg.reward.fns)] or \
        [(cfg.reward.fn, cfg.reward.fn_options)]
    if cfg.reward.server.serve_fn:
        return
    for fn, options in specs:
        if fn in BUILTIN_REWARDS:
            check_options(fn, options)
        else:
            import_by_path(fn, "reward.fns" if cfg.reward.fns else "reward.fn")


def check_ground_truths(cfg: RunConfig, name: str, files: list[str], data: PromptDataset | None,
                        is_main: bool = True) -> None:
    """A built-in reward that needs answers, over data where no row has `data.answer_key`, is a misnamed key (every
    sample's reward would fail and fall back): an InputError before the run starts. Rows missing only some answers
    fall back one by one, as the reward pool does for any failed sample, and a line on stderr counts them. `name`:
    the field that lists `files` (data.train_files)."""
    fns = [e.get("fn") for e in cfg.reward.fns if isinstance(e, dict)] or [cfg.reward.fn]
    needs = [fn for fn in fns if fn in GROUND_TRUTH_REWARDS]
    if data is None or not needs:  # (an empty dataset is refused when built)
        return
    missing = sum(e.ground_truth is None for e in data.examples)
    if missing == len(data):
        raise InputError(f"data.answer_key={cfg.data.answer_key!r}: no row of {', '.join(files)} has it, and "
                         f"reward.fn={needs[0]} scores each response against it")
    if missing and is_main:
        print(f"{name}: {missing} of {len(data)} rows have no {cfg.data.answer_key!r} (data.answer_key): reward.fn="
              f"{needs[0]} fails on their samples, which fall back (reward.fallback={cfg.reward.fallback})",
              file=sys.stderr)


def beside_checkpoint(actor_checkpoint: Path, name: str, why: str) -> Path:
    """Another model's checkpoint saved with `actor_checkpoint` (<name>/step_N beside it); `why` it is needed."""
    path = actor_checkpoint.parent / name / actor_checkpoint.name
    if not (path / "meta.json").is_file():
        raise InputError(f"{actor_checkpoint}: no {name} checkpoint saved with it ({path}), and {why}")
    return path


def build_reference(cfg: RunConfig, actor: Actor, env: RunEnv) -> PolicyForward | AdapterOffReference:
    """The KL reference: under LoRA the actor with its adapters off (the frozen base model, no second copy, as
    verl's); else a frozen copy of model.path."""
    if actor.lora_modules:
        return AdapterOffReference(actor)
    return PolicyForward(load_pretrained(cfg.model.path, dtype=dtype_of(cfg.model.dtype)), env.device,
                         cfg.actor.max_tokens_per_micro_batch, cfg.model.logprob_chunk_tokens, ep=cfg.parallel.ep)


def build_components(cfg: RunConfig, resume: bool) -> Components:
    check_runtime_support(cfg)
    check_reward_config(cfg)
    env = RunEnv.create(cfg)
    if cfg.actor.ppo_mini_batch_size % env.world_size:
        ranks = "data-parallel ranks" if env.dp_size == env.world_size else "ranks (each generates its share of a mini-batch)"
        raise InputError(f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} must be divisible by the "
                         f"{env.world_size} {ranks}")
    tokenizer = load_tokenizer(cfg)
    d = cfg.data
    tools = prompt_tools(cfg.rollout.multi_turn)
    train = PromptDataset(load_rows(d.train_files, d.seed, d.train_max_samples), tokenizer, d, tools=tools)
    val = PromptDataset(load_rows(d.val_files, d.seed, d.val_max_samples), tokenizer, d, tools=tools) \
        if d.val_files else None
    for name, files, data in (("data.train_files", cfg.data.train_files, train), ("data.val_files", cfg.data.val_files, val)):
        check_ground_truths(cfg, name, files, data, env.is_main)
        if data is not None:
            data.note_dropped(name, env.is_main)
    cfg.trainer.steps = training_steps(cfg, len(train))  # resolved once: every later use reads trainer.steps
    write_run_config(cfg, env.run_dir, env.is_main)
    if env.device.type == "cpu":
        retain_freed_host_memory()  # gradients are freed and allocated again every step
    actor = Actor(load_policy(cfg), cfg.actor, env.device, cfg.data.max_response_length,
                  cfg.model.logprob_chunk_tokens, cfg.trainer.steps, ep=cfg.parallel.ep, seed=cfg.trainer.seed,
                  master_weights=cfg.model.fp32_master_weights)
    ref = build_reference(cfg, actor, env) if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward else None
    critic = Critic(load_policy(cfg), cfg.critic, env.device, cfg.data.max_response_length,
                    cfg.trainer.steps, ep=cfg.parallel.ep,
                    master_weights=cfg.model.fp32_master_weights) if cfg.critic.enable else None
    if cfg.rollout.mode == "disaggregated":
        engine = RemoteEngine(cfg, rollout_device(cfg, env.device), rollout_threads(cfg))
        transport = ProcessTransport()
    else:
        engine = build_engine(cfg, engine_model(cfg, env, actor), tokenizer)
        transport = _colocated_transport(cfg, env)
    if shares_weights(cfg):
        drain_before_step(actor.optimizer, engine)  # weights it shares change at the optimizer step
    ckpt = CheckpointManager.for_run(cfg)
    latest = resume_from(ckpt, resume, env.is_main, cfg.checkpoint.resume_from)
    c = Components(
        cfg=cfg, env=env, tokenizer=tokenizer, train=train, val=val,
        cursor=EpochCursor(len(train), cfg.data.seed, cfg.data.shuffle), actor=actor, ref=ref, critic=critic, engine=engine,
        rollout=RolloutWorker(engine, tokenizer, cfg.data.max_response_length, env.rank, cfg.rollout.multi_turn),
        rewards=RewardPool.from_config(cfg.reward),
        syncer=WeightSyncer(transport, cfg.sync.bucket_bytes, cfg.sync.verify),
        ckpt=ckpt,
        logger=MetricsLogger.for_run(cfg, env.run_dir, env.is_main, append=latest is not None),
        kl_ctrl=KLController(cfg.algorithm),
    )
    if env.device.type == "cuda":
        c.planned_peak_bytes = predict_peak_bytes(cfg, actor.model.cfg)
    if latest is not None:
        meta = actor_state_load(c.ckpt, latest, c.actor, c.cursor)
        c.start_step = meta["step"]
        if "kl_ctrl" in meta:  # (checkpoints from before the controller: the configured coefficient)
            c.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        if c.critic is not None:
            c.critic_ckpt.load(beside_checkpoint(latest, "critic", "critic.enable=true"), c.critic.model,
                               c.critic.optimizer)
        if c.ref is not None and cfg.actor.ref_sync_steps and c.start_step >= cfg.actor.ref_sync_steps:
            path = beside_checkpoint(latest, "ref", f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} has moved the "
                                     f"reference policy since step {cfg.actor.ref_sync_steps}")
            c.beside_ckpt("ref").load(path, c.ref.model, None)
        c.syncer.push(c.actor.named_weights(), c.engine, version=meta["step"])
    c.logger.start_at(c.start_step)
    return c
