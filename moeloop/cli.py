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
Modules load lazily so `moeloop --help` stays fast.
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
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except (InputError, FileNotFoundError) as err:  # the user's input, named in the message: no traceback
        print(f"moeloop {name}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
