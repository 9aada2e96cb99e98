"""`moeloop rl CONFIG [overrides] [--resume]`: the RL loop, reading like the algorithm.

    prompts -> rollout (n per prompt) -> reward -> old/ref logprobs -> advantages
            -> actor update (mini/micro batches) -> weight push (drained, verified, versioned)
            -> metrics -> checkpoint
Under torchrun every rank colocates its own engine and generates its share of the prompts; the
trainer makes N ranks equal to one (see moeloop.train.actor).
rollout.mode=async (`RolloutAhead`): step t+1's batch is generated on a thread while the actor updates on step t's,
with the weights of before that update, so generation and training overlap and each batch is one version old.
rollout.mode=disaggregated: the engine runs in a process of its own on its own device (`loop.remote_rollout`); with
rollout.max_staleness >= 1 the thread only waits for it, so the two really run at once.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch
import torch.distributed as dist

from moeloop.algo.advantages import compute_advantages
from moeloop.algo.dapo import filter_uniform_groups, mask_truncated, overlong_penalty
from moeloop.algo.token_rewards import kl_in_reward_sums
from moeloop.config import RunConfig
from moeloop.loop.components import Components, build_components
from moeloop.loop.dump import dump_rollouts
from moeloop.loop.env import run_command
from moeloop.loop.metrics import PhaseTimer, peak_memory_bytes
from moeloop.loop.remote_rollout import half_threads
from moeloop.loop.step_metrics import batch_metrics, logprob_mismatch, tool_metrics
from moeloop.parallel.collectives import global_values
from moeloop.parallel.groups import replica_group, replica_size
from moeloop.reward.composite import component_names
from moeloop.train.actor import mix_into
from moeloop.types import Sample


def run_rl(cfg: RunConfig, resume: bool = False) -> dict[str, float]:
    c = build_components(cfg, resume)
    last: dict[str, float] = {}
    if c.start_step == 0 and cfg.trainer.val_every and (cfg.trainer.val_before_train or cfg.trainer.steps == 0):
        c.logger.log(0, c.evaluate(0), "val.jsonl")
    batches = RolloutAhead(c, cfg) if cfg.rollout.generates_ahead else RolloutInLine(c, cfg)
    try:
        for step in range(c.start_step, cfg.trainer.steps):
            last = _rl_step(c, cfg, step, batches)
    finally:  # (a failed run too: an engine process of its own ends here, not when this process does)
        batches.close()
        c.finish()
    return last


def _rl_step(c: Components, cfg: RunConfig, step: int, batches: RolloutInLine) -> dict[str, float]:
    """One step: batch -> ... -> weight push -> metrics -> checkpoint; the step's metrics."""
    timer = PhaseTimer()
    samples, reward_metrics, beside = batches.take(step, timer)
    batches.start(step + 1)  # async: on the engine's current weights, while this step trains
    samples = pool_replicas(samples, cfg)
    reward_metrics = global_reward_metrics(reward_metrics)
    with timer("old_log_prob"):
        fill_old_logprobs(c, cfg, samples, batches.off_policy)
    with timer("ref"):
        if c.ref is not None:
            c.ref.compute_logprobs(samples, "ref_logprobs")
    with timer("values"):
        if c.critic is not None:
            c.critic.compute_values(samples)
    with timer("adv"):
        kl_metrics = kl_in_reward(c, cfg, samples) if cfg.algorithm.use_kl_in_reward else {}
        compute_advantages(samples, cfg.algorithm)
    if cfg.trainer.rollout_data_dir:
        dump_rollouts(cfg.trainer.rollout_data_dir, step + 1, samples, c.env.is_main)
    with timer("update_critic"):
        critic_metrics = c.critic.update(samples) if c.critic is not None else {}
    warming_up = c.critic is not None and step < cfg.trainer.critic_warmup  # the critic learns the policy's
    with timer("update_actor"):  # values first; the policy (and so the engine's weights) stays as it is
        update_metrics = {} if warming_up else c.actor.update(samples)
    batches.join(timer)  # async: the engine finishes the next batch on its weights before they change
    with timer("update_weights"):
        sync = c.syncer.push(c.actor.named_weights(), c.engine, version=step + 1)
        every_ref = cfg.actor.ref_sync_steps  # the reference moves toward the policy (verified: a KL term reads it)
        ref_synced = bool(c.ref is not None and every_ref and (step + 1) % every_ref == 0)
        if ref_synced:
            mix_into(c.ref.model, c.actor.model, cfg.actor.ref_sync_alpha)
    every, last_step = cfg.trainer.val_every, step + 1 == cfg.trainer.steps  # (the last step too, as verl's)
    val_metrics = c.evaluate(step + 1) if every and ((step + 1) % every == 0 or last_step) else {}
    with timer("save_checkpoint"):
        c.maybe_save(step + 1)
    last = {**batch_metrics(samples, timer.seconds, beside.get("gen"), component_names(cfg.reward.fns)),
            **logprob_mismatch(samples),
            **(tool_metrics(samples) if cfg.rollout.multi_turn.enabled else {}),
            **reward_metrics, **update_metrics, **critic_metrics, **val_metrics, **timer.pop(),
            **{f"time/{k}_beside": v for k, v in beside.items()},
            "sync/gb_per_s": sync.gb_per_s, "sync/bytes": sync.num_bytes, "policy/version": sync.version,
            "policy/sample_lag": step - min((s.policy_version for s in samples), default=step),
            "memory/peak_bytes": peak_memory_bytes(c.env.device), "memory/planned_peak_bytes": c.planned_peak_bytes,
            **({"ref/synced": float(ref_synced)} if every_ref else {})}
    last.update(kl_metrics)
    c.logger.log(step + 1, last)
    if val_metrics:
        c.logger.log(step + 1, val_metrics, "val.jsonl")
    return last


class RolloutInLine:
    """rollout.mode=colocated (and disaggregated at max_staleness 0): each step's batch is generated when the step
    starts, on the weights it trains."""

    off_policy = False  # the batch comes from the policy it trains

    def __init__(self, c: Components, cfg: RunConfig):
        self.c, self.cfg = c, cfg

    def take(self, step: int, timer: PhaseTimer) -> tuple[list[Sample], dict[str, float], dict[str, float]]:
        """Step `step`'s batch, its reward metrics, and the phases of it that ran beside the previous step (none:
        its phases are in `timer`)."""
        samples, metrics = collect_batch(self.c, self.cfg, timer, step)
        return samples, metrics, {}

    def start(self, step: int) -> None:
        """(Nothing runs ahead.)"""

    def join(self, timer: PhaseTimer) -> None:
        """(Nothing is in flight.)"""

    def close(self) -> None:
        """(No thread to stop.)"""


class RolloutAhead(RolloutInLine):
    """rollout.mode=async: while the actor trains on step t's batch, a thread generates and scores step t+1's on the
    engine's own copy of the weights (those of before step t's update), so each batch is one version older than the
    actor that trains on it; the PPO ratio then uses the rollout's logprobs as the old policy's (the policy that
    sampled them: the importance correction). The weight push waits for that batch (`join`).
    No batch is generated ahead across a checkpoint, so a run resumed from one does what the straight run did, and
    none past the last step. On CUDA the thread runs on its own stream (`PhaseTimer` waits for one stream only).
    rollout.mode=disaggregated: the engine is another process's (`RemoteEngine`), which the thread waits for."""

    off_policy = True  # one version behind the actor

    def __init__(self, c: Components, cfg: RunConfig):
        super().__init__(c, cfg)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeloop-rollout")
        self.pending: tuple[int, Future] | None = None
        self.ready: tuple[int, list[Sample], dict[str, float], dict[str, float]] | None = None
        local = cfg.rollout.mode == "async"  # the engine is in this process
        self.stream = torch.cuda.Stream(c.env.device) if local and c.env.device.type == "cuda" else None
        # the two threads' ops (or this process's and the engine process's) share the host's cores: each gets half
        # the intra-op threads (`remote_rollout.half_threads`). (The demo on 2 cores: 0.125 s a step with all
        # threads each, 0.098 s with half, 0.076 s synchronous; where each phase runs on one thread anyway, async
        # pays: e2e_vs_trl.py --threads 1, 0.041 against 0.052-0.060 s. On GPUs too: the update's few host ops at
        # all 32 cores' threads, beside the engine process, took update_actor from 0.22 to 0.32 s on the H200;
        # BENCHMARKS.md, sessions 20-21)
        self.threads = torch.get_num_threads()
        torch.set_num_threads(half_threads(self.threads))

    def start(self, step: int) -> None:
        """Generate step `step`'s batch on the thread, unless there is no such step or a checkpoint comes first."""
        if step >= self.cfg.trainer.steps or self.c.saves_at(step):
            return
        self.pending = (step, self.pool.submit(self._collect, step))

    def _collect(self, step: int) -> tuple[list[Sample], dict[str, float], dict[str, float]]:
        timer = PhaseTimer()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            samples, metrics = collect_batch(self.c, self.cfg, timer, step)
        return samples, metrics, timer.seconds

    def join(self, timer: PhaseTimer) -> None:
        """Wait for the batch in flight (phase "wait_rollout"), keeping it for `take`."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        with timer("wait_rollout"):
            self.ready = (step, *future.result())

    def take(self, step: int, timer: PhaseTimer) -> tuple[list[Sample], dict[str, float], dict[str, float]]:
        """Step `step`'s batch: the one generated ahead (with its thread's phases), or generated now (the first
        step, after a checkpoint)."""
        if self.ready is None:
            return super().take(step, timer)
        ahead_step, samples, metrics, seconds = self.ready
        if ahead_step != step:
            raise RuntimeError(f"async rollout: holding step {ahead_step}'s batch at step {step}")
        self.ready = None
        return samples, metrics, seconds

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        torch.set_num_threads(self.threads)


def kl_in_reward(c: Components, cfg: RunConfig, samples: list[Sample]) -> dict[str, float]:
    """Shape the rewards with the KL penalty at the controller's coefficient, then let an adaptive controller move
    it by the step's KL (a mean over every rank's tokens, so all ranks keep the same coefficient)."""
    coef = c.kl_ctrl.coef
    kl_sum, num_tokens, num_samples = global_values([*kl_in_reward_sums(samples, cfg.algorithm, coef), len(samples)])
    kl = kl_sum / max(num_tokens, 1.0)
    c.kl_ctrl.update(kl, int(num_samples))
    return {"kl_in_reward": kl, "kl_in_reward/coef": coef}


def fill_old_logprobs(c: Components, cfg: RunConfig, samples: list[Sample], off_policy: bool = False) -> None:
    """Old-policy logprobs: from the rollout (bypass, and always for an `off_policy` batch: the policy that
    sampled it is the old one), recomputed, or — when the update is exactly on-policy (one epoch, one mini-batch,
    no KL-in-reward) — left unset: the actor then uses its own detached logprobs, which is the same gradient
    without a second forward pass. With actor.top_entropy_quantile < 1 the pass always runs, for the old policy's
    entropies (`sample.old_entropy`)."""
    bypass = cfg.old_logprobs_from_rollout(off_policy)
    if bypass:
        for s in samples:
            s.old_logprobs = list(s.response_logprobs)
    entropy = cfg.actor.top_entropy_quantile < 1  # the token selection reads the old policy's entropies
    if cfg.old_logprob_pass(off_policy):  # router replay: R2 records the experts here, R3 replays the rollout's
        routes = {"R2": "record", "R3": "replay"}.get(cfg.actor.router_replay, "off")
        c.actor.compute_logprobs(samples, None if bypass else "old_logprobs", routes,
                                 entropy_field="old_entropy" if entropy else None)


def collect_batch(c: Components, cfg: RunConfig, timer: PhaseTimer, step: int) -> tuple[list[Sample], dict[str, float]]:
    """Generate and score this rank's prompts; with DAPO dynamic sampling, refill dropped groups."""
    if not cfg.algorithm.dynamic_sampling:
        fresh, reward_metrics = _generate_and_score(c, cfg, timer, step, 0, *c.next_prompts(c.prompts_per_rank))
        return fresh, reward_metrics
    return _dynamic_batch(c, cfg, timer, step)


PROMPT_POSITION = "prompt_position"  # a sample's prompt's place in the step's batch, under context or tensor parallelism


def pool_replicas(samples: list[Sample], cfg: RunConfig) -> list[Sample]:
    """Under context or tensor parallelism each rank generated its share of the prompts, and the cp * tp ranks of a
    replica group train on their samples together: every rank of the group gets all of them, in prompt position order
    (the order a data-parallel rank holds its share in, which the mini-batch cut follows). DAPO's kept groups were
    dealt by dp rank already. On the main thread: a rollout thread (rollout.mode=async) runs no collective."""
    if replica_size() == 1 or cfg.algorithm.dynamic_sampling:
        return samples
    mine = [(s.metadata[PROMPT_POSITION], i, s) for i, s in enumerate(samples)]
    parts: list[list] = [[] for _ in range(replica_size())]
    dist.all_gather_object(parts, mine, group=replica_group())
    return [s for _, _, s in sorted((x for part in parts for x in part), key=lambda entry: entry[:2])]


def _generate_and_score(c: Components, cfg: RunConfig, timer: PhaseTimer, step: int, round_idx: int,
                        examples: list, positions: list[int]) -> tuple[list[Sample], dict[str, float]]:
    remax = cfg.algorithm.adv_estimator == "remax"
    with timer("gen"):
        params, k = c.train_params(step, round_idx, positions), len(examples)
        base = c.next_group_base(2 * k if remax else k)
        if remax:  # each prompt's greedy response too, in the same generate call (groups base + k ...)
            greedy_params = [c.greedy_params(cfg.rollout.repetition_penalty)] * k
            both = c.rollout.generate(examples + examples, params + greedy_params, base)
            fresh, greedy = [s for s in both if s.group_id < base + k], [s for s in both if s.group_id >= base + k]
        else:
            fresh = c.rollout.generate(examples, params, base)
        if replica_size() > 1:  # (for `pool_replicas`)
            for s in fresh:
                s.metadata[PROMPT_POSITION] = positions[s.group_id - base]
    with timer("reward"):
        stats = c.rewards.score(fresh)
        if remax:
            c.rewards.score(greedy)  # (its own fallbacks: those prompts' samples get no advantage)
            baselines = {s.group_id - k: s.reward if s.in_loss else None for s in greedy}
            for s in fresh:
                s.baseline = baselines[s.group_id]
        if stats.errors:  # (reward.fallback=fail raised already)
            c.logger.note(f"step {step + 1}: {len(stats.errors)} of {len(fresh)} rewards fell back "
                          f"(reward.fallback={cfg.reward.fallback}); first error: {stats.errors[0]}")
        if cfg.algorithm.overlong_penalty:
            overlong_penalty(fresh, cfg.data.max_response_length, cfg.algorithm.overlong_buffer_len,
                             cfg.algorithm.overlong_penalty_factor)
        if cfg.algorithm.mask_truncated:  # (how many: response/clip_ratio)
            mask_truncated(fresh)
    metrics = stats.metrics()
    if remax:  # a sum over the samples, so reward/baseline_rate is their prompts' mean greedy reward
        metrics["reward/baseline"] = sum(s.baseline or 0.0 for s in fresh)
    return fresh, metrics


def _dynamic_batch(c: Components, cfg: RunConfig, timer: PhaseTimer, step: int) -> tuple[list[Sample], dict[str, float]]:
    """DAPO dynamic sampling, decided over the global batch: each round draws the missing number of prompts, the
    ranks generate them round-robin, and every group whose rewards are not all equal is kept in (round, prompt
    position) order until there are `train_batch_size`. The kept groups are then dealt to the ranks as
    `next_prompts` deals a fresh batch, so N ranks train on exactly what one rank would."""
    world, rank = c.env.world_size, c.env.rank
    kept: list[tuple[int, int, list[Sample]]] = []  # (round, global position, the group's samples)
    reward_metrics: dict[str, float] = {}
    batch = cfg.data.train_batch_size
    for round_idx in range(1 + cfg.algorithm.max_refill_rounds):
        want = batch - len(kept)
        indices = c.cursor.take(want)  # every rank takes the same prompts; rank r generates positions r, r + N, ...
        positions = list(range(rank, want, world))
        fresh, metrics = _generate_and_score(c, cfg, timer, step, round_idx, [c.train[indices[p]] for p in positions],
                                             positions)
        reward_metrics = _merge_reward_metrics(reward_metrics, metrics)
        groups: dict[int, list[Sample]] = {}  # prompt order (the engine returns completions prompt-major)
        for s in fresh:
            groups.setdefault(s.group_id, []).append(s)
        keep_ids = {s.group_id for s in filter_uniform_groups(fresh)}
        mine = [(round_idx, p, g) for p, (gid, g) in zip(positions, groups.items()) if gid in keep_ids]
        kept = sorted(kept + _gather(mine, world), key=lambda entry: entry[:2])
        if len(kept) >= batch:
            break
    kept = kept[:batch]  # dealt to the DP ranks (the cp * tp ranks of a replica take the same groups)
    dp, dp_rank = c.env.dp_size, c.env.dp_rank
    per_mini = max(1, min(cfg.actor.ppo_mini_batch_size, len(kept)) // dp)
    samples = [s for p, (_, _, g) in enumerate(kept) if (p // per_mini) % dp == dp_rank for s in g]
    reward_metrics["dapo/kept_groups"] = float(len(kept))
    return samples, reward_metrics


def _gather(items: list, world: int) -> list:
    """Every rank's `items`, concatenated in rank order (the list itself on one rank)."""
    if world == 1:
        return items
    gathered: list[list] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def global_reward_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The reward pool's counts summed over refill rounds (already) and DP ranks, each rate recomputed over all
    the step's scored samples, the wall time the slowest rank's. Collective under DP."""
    counts = sorted(k for k in metrics if k.startswith("reward/") and not k.endswith(("_rate", "elapsed_s")))
    totals = dict(zip(counts, global_values([metrics[k] for k in counts], dist.ReduceOp.SUM, every_rank=True)))
    out = {**metrics, **totals}
    if "reward/elapsed_s" in metrics:
        (out["reward/elapsed_s"],) = global_values([metrics["reward/elapsed_s"]], dist.ReduceOp.MAX, every_rank=True)
    num = totals.get("reward/samples", 0.0)
    for k in counts:
        if k != "reward/samples":
            out[f"{k}_rate"] = totals[k] / num if num else 0.0
    return out


def _merge_reward_metrics(old: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    return {k: old.get(k, 0.0) + v if not k.endswith("_rate") else v for k, v in new.items()}


def main(argv: list[str]) -> int:
    return run_command(argv, "rl", run_rl)
