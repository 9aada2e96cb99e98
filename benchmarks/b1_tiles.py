"""The B=1 decode's kernel tiles, measured in place: the engine's forward graph (reference Qwen3-MoE, bf16, one
sequence, prompt 128) for each tile of the one-token kernels, varied one knob at a time from the current best
(coordinate descent), with every config's greedy tokens compared with the defaults'.

`b1_gemv.py` picked the tiles from each kernel alone and from a four-kernel chain. In the engine every kernel
shares the GPU with its PDL neighbours, which load their weights while it runs, so the best tile there may differ.

    python3 benchmarks/b1_tiles.py [--rounds 2] [--replays 200] [--pairs 4] [--knobs a,b] [--ab name=value ...]

One timing of a config drifts by about 10 us from one engine to the next (clocks, placement), about the size of the
gains looked for, so the sweep's best is then measured against the defaults in alternation (`--pairs` of each) and
each knob's change alone against the defaults the same way.

Knobs (module constants read at each launch, so a fresh engine's graph capture takes them):
  row_linear  fused_decode.ROW_LINEAR_TILE   (rows per program, warps): q|k|v (and o_proj without a composed router)
  o_proj      fused_decode.O_PROJ_TILE       (o_proj rows per program, warps) of the composed router's o_proj launch
  router      fused_decode.ROUTER_TILE       (rows per program, warps): the router's norm-folded projection
  gate_up     moe_kernel.GATE_UP_FEW_TILE    (ffn rows per program, warps)
  down        moe_kernel.DOWN_FEW_TILE       (output rows per program, warps)
  paged_block_n  decode_kernel.PAGED_BLOCK_N  (cached positions per step and per split unit: B=1 runs ceil(384 / it)
                                              split programs per kv head, then the merge)
  max_splits  decode_kernel.MAX_SPLITS       (1: one program per kv head loops over the context, no merge launch)
  paged_stages, paged_warps  decode_kernel.PAGED_STAGES, PAGED_WARPS_ONE_ROW: the paged decode's pipeline stages
                                              (a one-split program's loads in flight) and its warps at one row
  merge_warps  decode_kernel.MERGE_WARPS       the split merge's warps
  lm_head_fold, lm_head  fused_decode.LM_HEAD_FOLD, LM_HEAD_TILE: the final norm folded into a one-token lm_head
                                                 launch instead of `_add_rmsnorm` then cuBLAS

`--ab name=value[;name=value]` (repeatable) also measures that change against the defaults in alternation, whatever
the sweep found (e.g. `--ab lm_head_fold=False`: the fold's A/B). `--rounds 0` runs only those.

The sweep's best, where it differs from the defaults, is also printed as environment settings (MOELOOP_*_TILE and
the like: each knob reads its variable at import), to run it without a code change on the GPU it was found on.

`--engine-ab N` then runs `rollout.py` at B=1 (the engine.step times, 5 repeats) N times in alternation with the
defaults for the change that gained most in its A/B (at least `--engine-min-us`, default 1 us a forward), in fresh
processes with the knobs set through their environment variables.
"""
from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from cuda_kernels import replay_seconds
from moeloop.model.factory import build_model
from moeloop.rollout import SamplingParams, decode_kernel, fused_decode, moe_kernel
from sized_engine import sized_engine

KNOBS = {
    "row_linear": (fused_decode, "ROW_LINEAR_TILE", [(2, 4), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8), (16, 4),
                                                     (16, 8)]),
    "o_proj": (fused_decode, "O_PROJ_TILE", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4),
                                             (4, 8), (8, 2), (8, 4), (8, 8)]),
    "gate_up": (moe_kernel, "GATE_UP_FEW_TILE", [(4, 4), (4, 8), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8)]),
    "down": (moe_kernel, "DOWN_FEW_TILE", [(1, 2), (2, 1), (2, 2), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (8, 8)]),
    "paged_block_n": (decode_kernel, "PAGED_BLOCK_N", [16, 32, 64, 128]),
    "max_splits": (decode_kernel, "MAX_SPLITS", [1, 2, 3, 4, 8, 16]),
    "paged_stages": (decode_kernel, "PAGED_STAGES", [3, 4, 6]),
    "paged_warps": (decode_kernel, "PAGED_WARPS_ONE_ROW", [4, 8]),
    "merge_warps": (decode_kernel, "MERGE_WARPS", [1, 2, 4]),
    "lm_head_fold": (fused_decode, "LM_HEAD_FOLD", [True, False]),
    "lm_head": (fused_decode, "LM_HEAD_TILE", [(2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (16, 4),
                                               (16, 8)]),
    "router": (fused_decode, "ROUTER_TILE", [(4, 4), (4, 1), (4, 2), (2, 1), (1, 1), (2, 2), (16, 4)]),
}
PROMPT, NEW = 128, 8


def env_setting(name: str, value) -> str:
    """`VAR=value` that gives knob `name` this value in a fresh process: each knob's constant reads MOELOOP_ and its
    own name at import (`kernel_switch.env_tile`; the fold: on|off)."""
    var = "MOELOOP_" + KNOBS[name][1]
    if isinstance(value, bool):
        return f"{var}={'on' if value else 'off'}"
    return f"{var}={','.join(map(str, value)) if isinstance(value, tuple) else value}"


def forward_graph_ms(model, prompt: list[int], replays: int) -> tuple[float, list[int]]:
    """(median ms per replay of the B=1 forward graph over 3 timings, greedy tokens) of a fresh engine, whose
    warm-up captures the graph under the current tiles."""
    engine = sized_engine(model, 1, PROMPT, NEW)
    tokens = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW))[0].response_ids
    graphs = engine.runner.graphs
    graph, _ = graphs.graphs[next(s for s in graphs.sizes if s >= 1)]
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(replay_seconds(graph, replays) * 1e3 for _ in range(3)), tokens


def engine_step(label: str, change: dict) -> None:
    """One B=1 `rollout.py` measurement (engine.step times) in a fresh process with `change`'s knobs set through
    their environment variables (`env_setting`)."""
    env = dict(os.environ, **dict(env_setting(name, value).split("=", 1) for name, value in change.items()))
    argv = [sys.executable, str(Path(__file__).with_name("rollout.py")), "--device", "cuda", "--size", "reference",
            "--batch", "1", "--repeats", "5", "--skip-hf", "--step-times"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    print(f"== engine, {label}" + ("" if out.returncode == 0 else f" (exit {out.returncode}: {out.stderr[-300:]})"))
    for line in out.stdout.splitlines():
        if line.startswith(("# B=1 engine.step", "# B=1 walls", "# B=1 by the engine.step", "| 1 |")):
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--ab", action="append", default=[], help="name=value: also A/B this change against the defaults")
    ap.add_argument("--knobs", default=",".join(KNOBS), help="comma-separated knobs the sweep varies (default: all)")
    ap.add_argument("--engine-ab", type=int, default=0, metavar="N",
                    help="rounds of rollout.py B=1 in alternation with the defaults for the A/Bs' best change")
    ap.add_argument("--engine-min-us", type=float, default=1.0,
                    help="the least A/B gain (us per forward) that --engine-ab measures in the engine")
    args = ap.parse_args()
    swept = args.knobs.split(",")
    if unknown := sorted(set(swept) - set(KNOBS)):
        ap.error(f"--knobs: {unknown} not among {sorted(KNOBS)}")
    model = build_model("qwen3_moe", "reference", seed=0).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(3, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    defaults = {name: getattr(mod, attr) for name, (mod, attr, _) in KNOBS.items()}
    best = dict(defaults)
    forward_graph_ms(model, prompt, args.replays)  # warm-up: the first engine's timing runs high
    base_ms, base_tokens = forward_graph_ms(model, prompt, args.replays)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B=1 forward graph, prompt {PROMPT}")
    print(f"defaults {best}: {base_ms:.4f} ms")
    best_ms = base_ms
    for rnd in range(args.rounds):
        for name in swept:
            mod, attr, tiles = KNOBS[name]
            for tile in tiles:
                if tile == best[name]:
                    continue
                setattr(mod, attr, tile)
                ms, tokens = forward_graph_ms(model, prompt, args.replays)
                same = "same tokens" if tokens == base_tokens else f"tokens differ: {tokens} vs {base_tokens}"
                print(f"round {rnd + 1} {name}={tile}: {ms:.4f} ms ({same})")
                if ms < best_ms and tokens == base_tokens:
                    best_ms, best[name] = ms, tile
            setattr(mod, attr, best[name])
    print(f"sweep's best {best}: {best_ms:.4f} ms (defaults {base_ms:.4f} ms)")
    changed = [name for name in KNOBS if best[name] != defaults[name]]
    if changed:
        print("the sweep's best in a fresh process: " + " ".join(env_setting(name, best[name]) for name in changed))
    candidates = [(f"{name}={best[name]}", {name: best[name]}) for name in changed]
    if len(changed) > 1:
        candidates.append(("all of them", {name: best[name] for name in changed}))
    for item in args.ab:
        change = {}
        for part in item.split(";"):
            name, value = part.split("=", 1)
            if name.strip() not in KNOBS:
                ap.error(f"--ab {item}: {name!r} is not one of the knobs {sorted(KNOBS)}")
            change[name.strip()] = ast.literal_eval(value)
        candidates.append((item, change))
    gained = []
    for label, change in candidates:
        pair_ms = {"defaults": [], label: []}
        for _ in range(args.pairs):
            for which, config in (("defaults", {}), (label, change)):
                for name, (mod, attr, _) in KNOBS.items():
                    setattr(mod, attr, config.get(name, defaults[name]))
                pair_ms[which].append(forward_graph_ms(model, prompt, args.replays)[0])
        a, b = (statistics.median(v) for v in pair_ms.values())
        print(f"A/B in alternation ({args.pairs} each): defaults {a:.4f} ms, {label} {b:.4f} ms, "
              f"{(a - b) * 1e3:+.1f} us per forward")
        if (a - b) * 1e3 >= args.engine_min_us:
            gained.append(((a - b) * 1e3, label, change))
    for _, label, change in sorted(gained, key=lambda g: g[0])[-1:] if args.engine_ab else []:
        for _ in range(args.engine_ab):
            engine_step("defaults", {})
            engine_step(label, change)


if __name__ == "__main__":
    main()
