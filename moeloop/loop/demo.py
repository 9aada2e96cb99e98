"""`moeloop demo`: the README's main job on a CPU in a few minutes.

Builds a tiny Qwen3-MoE and its tokenizer, SFTs it briefly on synthetic two-digit addition, then
runs GRPO with a verifiable reward; prints held-out accuracy (sampled and greedy) after SFT and after
RL, and leaves plots (reward.png, phases.png) and an HF export under runs/demo/.
`--task tools`: two-digit multiplication with the calculator tool (multi-turn rollouts): SFT on answers half of
which call the tool, then GRPO, which teaches the model to call it; also prints the tool calls a sample.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeloop.config import load_config
from moeloop.loop.plot import plot_run
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.factory import init_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


TASKS = {"arith": ("tiny_sft.yaml", "tiny.yaml"), "tools": ("tiny_tools_sft.yaml", "tiny_tools.yaml")}


def run_demo(out: Path, seed: int, sft_steps: int, rl_steps: int, task: str = "arith") -> dict[str, float]:
    sft_yaml, rl_yaml = TASKS[task]
    model_dir = init_model("qwen3_moe", "tiny", out / "model", seed=seed)
    sft_cfg = load_config(EXAMPLES / sft_yaml, [f"model.path={model_dir}", f"trainer.run_dir={out / 'sft'}",
                                                f"trainer.steps={sft_steps}", f"trainer.seed={seed}"])
    run_sft(sft_cfg)
    rl_cfg = load_config(EXAMPLES / rl_yaml, [f"model.path={out / 'sft' / 'hf'}", f"trainer.run_dir={out / 'rl'}",
                                              f"trainer.steps={rl_steps}", f"trainer.seed={seed}"])
    run_rl(rl_cfg)
    val = [json.loads(line) for line in (out / "rl" / "val.jsonl").read_text().splitlines()]
    plots = plot_run(out / "rl")
    # sampled = mean over trainer.val_samples samples per prompt at temperature 1 (the policy GRPO optimises)
    result = {"greedy_after_sft": val[0]["acc/val"], "greedy_after_rl": val[-1]["acc/val"],
              "sampled_after_sft": val[0]["acc/val_sampled"], "sampled_after_rl": val[-1]["acc/val_sampled"]}
    print(f"held-out accuracy after SFT: sampled {result['sampled_after_sft']:.3f}  greedy {result['greedy_after_sft']:.3f}")
    print(f"held-out accuracy after RL:  sampled {result['sampled_after_rl']:.3f}  greedy {result['greedy_after_rl']:.3f}")
    if task == "tools":
        steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
        result.update(tool_calls_first=steps[0]["rollout/tool_calls_per_sample"],
                      tool_calls_last=steps[-1]["rollout/tool_calls_per_sample"])
        print(f"tool calls a sample: {result['tool_calls_first']:.2f} at the first RL step, "
              f"{result['tool_calls_last']:.2f} at the last")
    print(f"plots: {', '.join(str(p) for p in plots)}; HF export: {out / 'rl' / 'hf'}")
    return result


def _steps(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeloop demo", description=__doc__)
    parser.add_argument("--task", choices=list(TASKS), default="arith",
                        help="arith: two-digit addition; tools: two-digit multiplication with the calculator tool")
    parser.add_argument("--out", default=None, help="default: runs/demo (arith), runs/tools (tools)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=_steps, default=None, help="default: examples/tiny_sft.yaml's")
    parser.add_argument("--rl-steps", type=_steps, default=None, help="default: examples/tiny.yaml's")
    args = parser.parse_args(argv)
    sft_yaml, rl_yaml = TASKS[args.task]
    sft_steps = load_config(EXAMPLES / sft_yaml).trainer.steps if args.sft_steps is None else args.sft_steps
    rl_steps = load_config(EXAMPLES / rl_yaml).trainer.steps if args.rl_steps is None else args.rl_steps
    out = args.out or {"arith": "runs/demo", "tools": "runs/tools"}[args.task]
    run_demo(Path(out), args.seed, sft_steps, rl_steps, args.task)
    return 0
