"""What tool turns cost the rollout engine: B samples of T assistant turns of K tokens each, a tool turn (the tiny
tokenizer's chat template around the calculator's answer, ~36 tokens) between them, against one turn of T*K tokens on
the same engine and prompts (the ceiling: the same sampled tokens with no turns). The multi-turn runs twice: with the
prefix cache as the engine keeps it (each turn's request finds the sample's earlier blocks), and with the cache dropped
before each turn (every turn then prefills the whole sample again, as an engine without a prefix cache would).

    python benchmarks/tool_turns.py                                               # CPU, tiny model
    python benchmarks/tool_turns.py --device cuda --size reference --batch 128   # H200, bf16

Columns: wall seconds (best of --repeats), sampled tokens/s (the assistant tokens only), the tokens the engine
prefilled, and the share of the wall time spent outside the engine (tool calls, tool-turn tokens, bookkeeping).
"""
from __future__ import annotations

import argparse
import time

import torch

from moeloop.config.schema import MultiTurnSection
from moeloop.data.dataset import Example
from moeloop.loop.generation import RolloutWorker
from moeloop.loop.tools import ToolCall, ToolTurn
from moeloop.model.factory import build_model
from moeloop.model.tokenizer import build_tokenizer
from moeloop.rollout import SamplingParams
from sized_engine import sized_engine


def always_calls(text: str) -> list[ToolCall]:
    """Every assistant turn asks the calculator (a random model writes no tool calls of its own)."""
    return [ToolCall("calculator", {"expression": "12*34"})]


class Timed:
    """The engine, its generate calls timed; `forget`: the prefix cache dropped before each call."""

    def __init__(self, engine, forget: bool, device: str):
        self.engine, self.forget, self.device, self.seconds = engine, forget, device, 0.0

    def generate(self, prompts, params):
        if self.forget:
            self.engine.blocks.reset_prefix_cache()
        sync(self.device)
        start = time.perf_counter()
        out = self.engine.generate(prompts, params)
        sync(self.device)
        self.seconds += time.perf_counter() - start
        return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(worker: RolloutWorker, engine, forget: bool, device: str, examples, params, repeats: int):
    """(best wall seconds, the engine's share of it, prefill tokens of that run, its samples)."""
    best = (float("inf"), 0.0, 0, [])
    for _ in range(repeats):
        engine.blocks.reset_prefix_cache()
        worker.engine = timed = Timed(engine, forget, device)
        before = engine.num_prefill_tokens
        sync(device)
        start = time.perf_counter()
        samples = worker.generate(examples, params, 0)
        wall = time.perf_counter() - start
        if wall < best[0]:
            best = (wall, timed.seconds / wall, engine.num_prefill_tokens - before, samples)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "reference"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = build_model("qwen3_moe", args.size, seed=0).to(device=args.device, dtype=dtype).eval()
    tok = build_tokenizer()
    tool_len = len(ToolTurn(tok).ids(["408"], closes_turn=False))
    T, K = args.turns, args.turn_tokens
    budget = T * K + (T - 1) * tool_len
    engine = sized_engine(model, args.batch, args.prompt_len, budget)
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(10, 90, (args.prompt_len,), generator=g).tolist(), "", "", "")
                for _ in range(args.batch)]
    cfg = MultiTurnSection(tools=["calculator"], max_turns=T, parser="tool_turns.always_calls", max_tokens_per_turn=K)
    params = SamplingParams(temperature=1.0, max_tokens=budget, seed=0, ignore_eos=True)
    warm = RolloutWorker(engine, tok, 2 * K + tool_len, multi_turn=MultiTurnSection(**{**vars(cfg), "max_turns": 2}))
    warm.generate(examples, SamplingParams(temperature=1.0, max_tokens=2 * K + tool_len, seed=1, ignore_eos=True), 0)
    print(f"# {args.size} on {args.device} ({dtype}), {args.batch} samples x {T} turns x {K} tokens, tool turns of "
          f"{tool_len} tokens, prompts of {args.prompt_len}")
    print(f"{'run':<28}{'wall s':>9}{'sampled tok/s':>15}{'prefilled':>11}{'engine share':>14}")
    rows = [("one turn of T*K tokens", RolloutWorker(engine, tok, T * K), False),
            ("T turns, prefix cache", RolloutWorker(engine, tok, budget, multi_turn=cfg), False),
            ("T turns, no prefix cache", RolloutWorker(engine, tok, budget, multi_turn=cfg), True)]
    one = SamplingParams(temperature=1.0, max_tokens=T * K, seed=0, ignore_eos=True)
    for name, worker, forget in rows:
        wall, share, prefilled, samples = run(worker, engine, forget, args.device, examples,
                                              one if worker.turns is None else params, args.repeats)
        sampled = sum(sum(s.loss_mask) if s.loss_mask else len(s.response_ids) for s in samples)
        assert sampled == args.batch * T * K, (name, sampled)
        print(f"{name:<28}{wall:>9.3f}{sampled / wall:>15,.0f}{prefilled:>11,}{share:>14.1%}")
        worker.close()


if __name__ == "__main__":
    main()
