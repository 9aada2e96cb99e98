"""The `moeloop` command: a thin dispatcher to each subsystem's entry point.

    moeloop config show examples/tiny.yaml actor.optim.lr=1e-5
    moeloop init-model --arch qwen3_moe --size tiny --out /tmp/m
    moeloop generate MODEL_DIR --prompts p.jsonl --out o.jsonl
    moeloop reward serve --fn arith --port 8011
    moeloop plan examples/plan_seed002.yaml --json
    moeloop sft|rl CONFIG [overrides] [--resume]
    moeloop plot RUN_DIR
    moeloop demo

Each entry is "module:function"; the function takes the remaining argv and returns an exit code.
Modules load lazily so `moeloop --help` stays fast. Ctrl-C ends a command with one line on stderr (for sft|rl: the
newest checkpoint to resume from) and exit code 130, after the command's own cleanup has run.
"""
from __future__ import annotations

import importlib
import os
import sys

from moeloop.errors import InputError

COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("moeloop.config.command:main", "show the resolved config: config show FILE [overrides]"),
    "init-model": ("moeloop.model.factory:main", "write a deterministic tiny model + tokenizer"),
    "generate": ("moeloop.rollout.command:main", "generate completions for a JSONL of prompts"),
    "reward": ("moeloop.reward.service:main", "reward service: reward serve --fn NAME"),
    "plan": ("moeloop.plan.command:main", "memory / layout / sync / checkpoint plan before launch"),
    "sft": ("moeloop.loop.sft:main", "supervised fine-tuning"),
    "rl": ("moeloop.loop.rl:main", "RL post-training (GRPO family, PPO)"),
    "plot": ("moeloop.loop.plot:main", "PNG charts of a run directory"),
    "ckpt": ("moeloop.checkpoint.command:main", "checkpoint tools: ckpt export CKPT --out DIR"),
    "demo": ("moeloop.loop.demo:main", "tiny CPU demo: make a model, SFT, then GRPO"),
}


def _usage() -> str:
    lines = ["usage: moeloop COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moeloop: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `moeloop` script: user code (reward.fn, tools) in the
        sys.path.append(os.getcwd())                         # working directory imports, as under python -m moeloop
    module_name, func_name = COMMANDS[name][0].split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except KeyboardInterrupt:  # (importing torch takes seconds)
        return _interrupted(name)
    try:
        return int(func(rest) or 0)
    except (InputError, FileNotFoundError) as err:  # the user's input, named in the message: no traceback
        print(f"moeloop {name}: {err}", file=sys.stderr)
        return 2
    except BaseException as err:  # noqa: BLE001 - Ctrl-C, once the run's `finally:` blocks (engines, loggers) ran
        if not _is_interrupt(err):
            raise
        return _interrupted(name, rest if name in ("sft", "rl") else None)


def _is_interrupt(err: BaseException | None) -> bool:
    """Ctrl-C, also where a library turned it into another exception: DCP hands each rank's exception to every rank
    inside a CheckpointException (a BaseException), and torch.save, interrupted mid-write, raises a RuntimeError as it
    closes its file (the KeyboardInterrupt is that error's __context__)."""
    if err is None:
        return False
    if isinstance(err, KeyboardInterrupt):
        return True
    dcp_api = sys.modules.get("torch.distributed.checkpoint.api")  # (loaded if a checkpoint was: no torch import here)
    inner = ([exc for exc, _ in err.failures.values()]
             if dcp_api is not None and isinstance(err, dcp_api.CheckpointException) else [])
    return any(_is_interrupt(e) for e in [*inner, err.__context__])


def _interrupted(name: str, run_argv: list[str] | None = None) -> int:
    """Ctrl-C: one line on stderr, naming the newest checkpoint of the run `run_argv` configures, and exit code 130
    (128 + SIGINT, what a shell reports for a process Ctrl-C ended). Under torchrun every rank is interrupted and
    returns 130; rank 0 says so."""
    if int(os.environ.get("RANK", "0")) == 0:
        note = _checkpoint_note(run_argv) if run_argv is not None else None
        print(f"moeloop {name}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr)
    return 130


def _checkpoint_note(argv: list[str]) -> str | None:
    """For an interrupted `moeloop sft|rl CONFIG [overrides]`: the newest complete checkpoint in the run's checkpoint
    directory (checkpoint.dir, else <trainer.run_dir>/checkpoints, as the loop makes it), or that there is none.
    None when the config does not load (the interrupt came before the command had checked it)."""
    from moeloop.checkpoint import CheckpointManager
    from moeloop.config import load_config

    args = [a for a in argv if a != "--resume"]
    if not args:
        return None
    try:
        cfg = load_config(args[0], args[1:])
    except (ValueError, OSError):  # (InputError is a ValueError)
        return None
    ckpt = CheckpointManager.for_run(cfg)
    directory, latest = ckpt.directory, ckpt.latest()
    if latest is None:
        return f"no checkpoint was saved in {directory}"
    return f"the newest checkpoint is {latest} (resume with --resume)"


if __name__ == "__main__":
    sys.exit(main())
