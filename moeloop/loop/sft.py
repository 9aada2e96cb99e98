"""`moeloop sft CONFIG [overrides] [--resume]`: supervised fine-tuning on prompt/response rows.

Same model code, data layer, trainer, checkpoints and logging as RL; the HF export it writes at the
end (`<run_dir>/hf`) is directly an RL `model.path`. Rows: prompt/response strings or chat conversations
(`moeloop.data.dataset`). With `data.val_files` and `trainer.val_every`, the held-out loss goes to val.jsonl
at step 0, every val_every steps and at the end.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeloop.checkpoint import CheckpointManager
from moeloop.config import RunConfig
from moeloop.config.schema import ActorSection
from moeloop.data import EpochCursor, PromptDataset, load_rows
from moeloop.loop.tools import prompt_tools
from moeloop.data.dataset import Example
from moeloop.errors import InputError
from moeloop.loop.env import (RunEnv, check_parallel_support, load_policy, load_tokenizer, resume_from, run_command,
                              training_steps, write_run_config)
from moeloop.loop.export import export_policy
from moeloop.loop.metrics import MetricsLogger, PhaseTimer, peak_memory_bytes
from moeloop.train.actor import Actor
from moeloop.train.lora import lora_meta
from moeloop.types import Sample


def run_sft(cfg: RunConfig, resume: bool = False) -> dict[str, float]:
    check_parallel_support(cfg)
    env = RunEnv.create(cfg)
    if cfg.data.train_batch_size % env.dp_size:  # each rank takes an equal slice; a remainder would be dropped
        raise InputError(f"data.train_batch_size={cfg.data.train_batch_size} must be divisible by the "
                         f"{env.dp_size} data-parallel ranks")
    tokenizer = load_tokenizer(cfg)
    d = cfg.data
    tools = prompt_tools(cfg.rollout.multi_turn)  # (the tool list an RL run with tools puts in its prompts)
    data = PromptDataset(load_rows(d.train_files, d.seed, d.train_max_samples), tokenizer, d, with_response=True,
                         tools=tools)
    data.note_dropped("data.train_files", env.is_main)
    val = None
    if d.val_files:  # each rank scores its slice of the held-out rows; the loss is summed over ranks
        val = PromptDataset(load_rows(d.val_files, d.seed, d.val_max_samples), tokenizer, d, with_response=True,
                            tools=tools)
        val.note_dropped("data.val_files", env.is_main)
        val = [_sample(val[i], i) for i in range(env.dp_rank, len(val), env.dp_size)]
    cursor = EpochCursor(len(data), cfg.data.seed, cfg.data.shuffle)
    model = load_policy(cfg)
    steps = cfg.trainer.steps = training_steps(cfg, len(data))  # resolved once, as RL's
    write_run_config(cfg, env.run_dir, env.is_main)
    actor = Actor(model, cfg.actor, env.device, cfg.data.max_response_length, cfg.model.logprob_chunk_tokens, steps,
                  ep=cfg.parallel.ep, seed=cfg.trainer.seed, master_weights=cfg.model.fp32_master_weights)
    ckpt = CheckpointManager.for_run(cfg)
    start = 0
    if (latest := resume_from(ckpt, resume, env.is_main, cfg.checkpoint.resume_from)) is not None:
        meta = actor_state_load(ckpt, latest, actor, cursor)
        start = meta["step"]
    logger = MetricsLogger.for_run(cfg, env.run_dir, env.is_main, append=start > 0)
    logger.start_at(start)
    try:  # (an interrupted or failed run closes its logs too: the progress bar, TensorBoard)
        timer, last = PhaseTimer(), {}
        val_every = cfg.trainer.val_every
        if val is not None and val_every and start == 0 and (cfg.trainer.val_before_train or steps == 0):
            logger.log(0, actor.sft_eval(val), "val.jsonl")
        per_rank = cfg.data.train_batch_size // env.dp_size  # (the cp * tp ranks of a replica take the same slice)
        for step in range(start, steps):
            indices = cursor.take(cfg.data.train_batch_size)[env.dp_rank * per_rank:(env.dp_rank + 1) * per_rank]
            with timer("update_actor"):
                last = actor.sft_step([_sample(data[i], i) for i in indices])
            if cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0:
                with timer("save_checkpoint"):
                    actor_state_save(ckpt, step + 1, actor, cursor)
            val_metrics = {}
            if val is not None and val_every and ((step + 1) % val_every == 0 or step + 1 == steps):
                val_metrics = actor.sft_eval(val)
                logger.log(step + 1, val_metrics, "val.jsonl")
            last.update(val_metrics)
            logger.log(step + 1, {**last, **timer.pop(), "memory/peak_bytes": peak_memory_bytes(env.device)})
        actor_state_save(ckpt, steps, actor, cursor)
        export_policy(actor, env.run_dir, cfg.model.path, write=env.is_main)
    finally:
        logger.close()
    return last


def _sample(example: Example, i: int) -> Sample:
    return Sample(prompt_ids=example.prompt_ids, response_ids=example.response_ids, loss_mask=example.loss_mask,
                  group_id=i)


def actor_state_save(ckpt: CheckpointManager, step: int, actor: Actor, cursor: EpochCursor, **extra) -> None:
    """Under LoRA the checkpoint holds the adapters and their optimizer state (the base is model.path), and its
    meta the adapters' settings (`lora`), which `moeloop ckpt export` applies again."""
    meta = {"cursor": cursor.state_dict(), "scheduler": _plain(actor.scheduler.state_dict()), **extra}
    if actor.lora_modules:
        meta["lora"] = lora_meta(actor.cfg)
    ckpt.save(step, actor.model, actor.optimizer, meta, trainable_only=bool(actor.lora_modules))


def actor_state_load(ckpt: CheckpointManager, path, actor: Actor, cursor: EpochCursor) -> dict:
    check_lora_meta(path, actor.cfg)
    meta = ckpt.load(path, actor.model, actor.optimizer, trainable_only=bool(actor.lora_modules))
    cursor.load_state_dict(meta["cursor"])
    actor.scheduler.load_state_dict({**actor.scheduler.state_dict(), **meta["scheduler"]})
    return meta


def check_lora_meta(path: Path, cfg: ActorSection) -> None:
    """A checkpoint resumes only under the LoRA settings it was saved with (a full fine-tuning one: none)."""
    saved = json.loads((Path(path) / "meta.json").read_text()).get("lora")
    here = lora_meta(cfg) if cfg.lora_rank else None
    if saved != here:
        raise InputError(f"{path}: saved with LoRA settings {saved or 'none (full fine-tuning)'}, and this run's "
                         f"actor.lora_rank / lora_alpha / lora_target_modules are {here or 'none (lora_rank=0)'}")


def _plain(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, list)) and k != "lr_lambdas"}


def main(argv: list[str]) -> int:
    return run_command(argv, "sft", run_sft)
