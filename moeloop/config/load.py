"""Load a run config: YAML file + dotted overrides, merged onto the typed schema, validated once.

    cfg = load_config("examples/tiny.yaml", ["actor.optim.lr=1e-5", "rollout.n=8"])
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moeloop.config.schema import RunConfig
from moeloop.errors import InputError


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Return a validated `RunConfig`; errors name the file or the override, the field and the rule."""
    base = OmegaConf.structured(RunConfig)
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        base = _merge(base, lambda: OmegaConf.load(path), f"config in {path}")
    base = _merge(base, lambda: OmegaConf.from_dotlist(list(overrides)), "config override")
    cfg: RunConfig = OmegaConf.to_object(base)  # type: ignore[assignment]
    _yaml_switches(cfg)
    validate(cfg)
    return cfg


ONE_PATH_FIELDS = ("data.train_files", "data.val_files")  # one path as a string, as verl's take it, is a list of one


def _merge(base: DictConfig, read: Callable[[], DictConfig], where: str) -> DictConfig:
    """`base` with what `read` gives merged on; an error names `where` (the file, or the overrides)."""
    try:
        conf = read()
        if not isinstance(conf, DictConfig):  # (a TypeError from the merge)
            raise InputError(f"{where}: must be a mapping of sections (model:, data:, ...), not a list")
        for key in ONE_PATH_FIELDS:
            if isinstance(OmegaConf.select(conf, key), str):
                OmegaConf.update(conf, key, [OmegaConf.select(conf, key)])
        return OmegaConf.merge(base, conf)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise InputError(f"{where}: {_explain(err)}") from None
    except yaml.YAMLError as err:  # not YAML (OmegaConf parses a file and each override's value with PyYAML)
        raise InputError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


SWITCH_FIELDS = (("rollout", "async_scheduling"), ("actor", "router_replay"), ("critic", "router_replay"))


def _yaml_switches(cfg: RunConfig) -> None:
    """YAML reads a bare off / on (no / yes) as a bool, which a str field then holds as "False" / "True": the
    fields whose values include off take them back as off / on."""
    for section_name, name in SWITCH_FIELDS:
        section = getattr(cfg, section_name)
        value = getattr(section, name)
        if value in ("False", "True"):
            setattr(section, name, "off" if value == "False" else "on")


def _explain(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = str(err).splitlines()[0]
    if "is not a ListConfig" in msg:  # ("Invalid value assigned: AnyNode is not a ListConfig, TupleConfig, ...")
        msg = f"must be a list, e.g. {key}=[{getattr(err, 'value', '...')}]"
    return f"{key}: {msg}" if key else msg


def validate(cfg: RunConfig) -> None:
    """Every section's own rules, then the rules that span sections."""
    for section in (cfg.model, cfg.data, cfg.rollout, cfg.reward, cfg.algorithm, cfg.sync, cfg.checkpoint, cfg.trainer,
                    cfg.hardware, cfg.parallel):
        section.check()
    cfg.actor.check("actor")
    if cfg.critic.enable:
        cfg.critic.check("critic")
    cfg.plan.check()
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    for name, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        # (each rank's budget: under context parallelism a micro-batch holds parallel.cp x as many tokens)
        cp = cfg.parallel.cp if name == "actor" else 1
        if (name == "actor" or cfg.critic.enable) and section.max_tokens_per_micro_batch * cp < longest:
            times = f" x parallel.cp={cp}" if cp > 1 else ""
            raise InputError(f"{name}.max_tokens_per_micro_batch={section.max_tokens_per_micro_batch}{times} must be >= "
                             f"data.max_prompt_length + data.max_response_length = {longest} (one whole sequence)")
    if cfg.algorithm.overlong_penalty and not 0 < cfg.algorithm.overlong_buffer_len <= cfg.data.max_response_length:
        raise InputError(f"algorithm.overlong_buffer_len={cfg.algorithm.overlong_buffer_len} must be in (0, "
                         f"data.max_response_length={cfg.data.max_response_length}] with algorithm.overlong_penalty")
    if cfg.trainer.val_every and not cfg.data.val_files:  # (it logged empty validation rows)
        raise InputError(f"trainer.val_every={cfg.trainer.val_every} needs held-out prompts in data.val_files; "
                         f"trainer.val_every=0 trains without validation")
    export = Path(cfg.trainer.run_dir) / "hf"  # (a resumed run reloads model.path, the KL reference among others)
    if cfg.model.path != "???" and export.resolve() == Path(cfg.model.path).resolve():
        raise InputError(f"trainer.run_dir={cfg.trainer.run_dir}: the run's HF export ({export}) would overwrite "
                         f"model.path={cfg.model.path}, the model it starts from; pick another trainer.run_dir")
    if cfg.trainer.log_val_generations and not cfg.trainer.val_every:  # (it would log nothing)
        raise InputError(f"trainer.log_val_generations={cfg.trainer.log_val_generations} needs trainer.val_every > 0 "
                         f"(and data.val_files): it logs the generations of each validation")
    if cfg.actor.ref_sync_steps and not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        raise InputError(f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} moves the reference policy, which only a "
                         f"KL term reads: set actor.use_kl_loss=true or algorithm.use_kl_in_reward=true")
    if cfg.actor.lora_rank and cfg.actor.ref_sync_steps:
        raise InputError(f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} with actor.lora_rank={cfg.actor.lora_rank}: "
                         f"under LoRA the reference is the actor with its adapters off (its frozen base weights), "
                         f"which cannot move toward the actor (as TRL refuses sync_ref_model with a PEFT model)")
    if cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enable:
        raise InputError("algorithm.adv_estimator=gae needs critic.enable=true")
    if cfg.trainer.critic_warmup < 0 or (cfg.trainer.critic_warmup and not cfg.critic.enable):
        raise InputError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} must be >= 0, and needs critic.enable=true")
    if cfg.actor.ppo_mini_batch_size > cfg.data.train_batch_size:
        raise InputError(
            f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} must be <= data.train_batch_size={cfg.data.train_batch_size}")
    if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
        raise InputError(
            f"data.train_batch_size={cfg.data.train_batch_size} must be a multiple of actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
