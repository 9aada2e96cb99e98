"""Where one decode step's time goes on the GPU: kernels per step, GPU busy time per step vs wall time per step,
the forward graph's GPU time alone, and the top kernels, for the engine's steady decode at given batch sizes
(reference Qwen3-MoE, bf16).

    python benchmarks/profile_decode.py --batch 1,256
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cuda_kernels import kernel_times, replay_seconds
from moeloop.model.factory import build_model
from moeloop.rollout import SamplingParams
from sized_engine import sized_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,256")
    ap.add_argument("--size", default="reference")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the host side of the timed steps")
    ap.add_argument("--no-row-linear", action="store_true",
                    help="B=1 projections through cuBLAS instead of the one-launch `_row_linear` kernel (A/B)")
    ap.add_argument("--no-qkv-pack", action="store_true", help="q, k, v as three GEMMs at B > 1 (A/B of `QKVPack`)")
    ap.add_argument("--no-router-fused", action="store_true",
                    help="router projection through cuBLAS + `_softmax_topk` instead of `_router_topk` (A/B)")
    ap.add_argument("--no-norm-fold", action="store_true",
                    help="B=1: add + RMSNorm as its own launch, not folded into the next projection (A/B)")
    ap.add_argument("--warps", default=None,
                    help="B=1 kernels' num_warps as ROW_LINEAR,GATE_UP,DOWN (A/B of the tiles; default: the modules')")
    ap.add_argument("--top-k", type=int, default=50, help="-1: full-vocab sampling at temperature 1 (the e2e job)")
    ap.add_argument("--timeline", action="store_true",
                    help="also the forward graph's kernels in replay order: the chain time each adds, by name, and "
                         "one middle layer's kernels with start, duration and end")
    ap.add_argument("--no-logprobs", dest="logprobs", action="store_false", help="skip the sampled tokens' logprobs")
    args = ap.parse_args()
    if args.no_qkv_pack:
        import moeloop.rollout.engine as engine_mod
        engine_mod.decode_weights_apply = lambda model: False
    if args.no_router_fused:
        import moeloop.rollout.fused_decode as fused_decode
        fused_decode.ROUTER_FUSED_MIN_TOKENS = 0
    if args.no_row_linear:
        import moeloop.rollout.fused_decode as fused_decode
        fused_decode.ROW_LINEAR = False
    if args.no_norm_fold:
        import moeloop.rollout.fused_decode as fused_decode
        fused_decode.NORM_FOLD = False
    if args.warps:
        import moeloop.rollout.fused_decode as fused_decode
        import moeloop.rollout.moe_kernel as moe_kernel
        rl, gu, dn = (int(w) for w in args.warps.split(","))
        fused_decode.ROW_LINEAR_TILE = (fused_decode.ROW_LINEAR_TILE[0], rl)
        moe_kernel.GATE_UP_FEW_TILE = (moe_kernel.GATE_UP_FEW_TILE[0], gu)
        moe_kernel.DOWN_FEW_TILE = (moe_kernel.DOWN_FEW_TILE[0], dn)
    model = build_model("qwen3_moe", args.size, seed=0).to("cuda", torch.bfloat16).eval()
    for B in [int(b) for b in args.batch.split(",")]:
        P, N = 128, 256
        engine = sized_engine(model, B, P, N)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, model.cfg.vocab_size, (B, P), generator=g).tolist()
        engine.generate(prompts, SamplingParams(max_tokens=4, top_k=args.top_k, seed=0, logprobs=args.logprobs))
        engine.blocks.reset_prefix_cache()  # above: warm-up + graph capture
        params = SamplingParams(max_tokens=N, top_k=args.top_k, seed=1, logprobs=args.logprobs)
        for p in prompts:  # one params object for all, as `Engine.generate` passes it
            engine.add_request(p, params)
        for _ in range(8):  # prefill, then into steady decode
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
        if args.host_profile:
            host = cProfile.Profile()
            host.enable()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            host.disable()
            pstats.Stats(host).sort_stats("tottime").print_stats(args.top + 8)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        by_name = kernel_times(prof)
        forward_ms = graph_replay_ms(engine, B)
        busy = sum(sum(v) for v in by_name.values()) / args.steps / 1e3
        print(f"B={B}: wall {wall * 1e3:.2f} ms/step, GPU kernel time {busy:.2f} ms/step, "
              f"{sum(len(v) for v in by_name.values()) / args.steps:.0f} kernels/step, "
              f"forward graph alone {forward_ms:.3f} ms")
        for name, times in list(by_name.items())[:args.top]:
            print(f"   {sum(times) / args.steps / 1e3:7.3f} ms/step  {len(times) / args.steps:5.0f}/step  "
                  f"{sum(times) / len(times):7.1f} us  {name[:90]}")
        if args.timeline:
            timeline(engine, B, model.cfg.num_layers)
        # the replays above ran graphs out of the engine's order: graphs share one memory pool, so a forward graph
        # replayed here may overwrite what a step graph keeps for the next step (the sampled tokens it patches in).
        # Drop this engine instead of finishing its requests (finishing them hit a device-side assert in an index
        # gather in session 16)
        del engine
        torch.cuda.empty_cache()


def graph_replay_ms(engine, batch: int, replays: int = 50) -> float:
    """GPU time per replay of the decode step's captured forward graph, back to back (no host work between, so no
    idle GPU): the device's share of a step. With PDL, kernels overlap, so the per-kernel times above add up to
    more than this."""
    graphs = engine.runner.graphs
    graph, _ = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
    graph.replay()  # (the step's own inputs again: the same K/V rewritten into the same slots)
    return 1e3 * replay_seconds(graph, replays)


def timeline(engine, batch: int, layers: int) -> None:
    """The captured forward graph's kernels, as the profiler saw one replay: per kernel name the chain time it adds
    (its end minus the previous kernel's end; with PDL a kernel starts before the previous one ends, so the
    durations overlap but these increments add up to the replay's span), then one middle layer's kernels."""
    graphs = engine.runner.graphs
    size = next(s for s in graphs.sizes if s >= batch)
    graph, _ = graphs.graphs[size]
    last, adds = replay_kernels(graph)
    t0 = last[0][0]
    print(f"B={batch} replay as profiled: {len(last)} kernels, span {max(e for _, e, _ in last) - t0:.1f} us "
          f"(sum of durations {sum(e - s for s, e, _ in last):.1f} us)")
    for name, a in sorted(adds.items(), key=lambda kv: -sum(kv[1])):
        print(f"   {sum(a):7.1f} us added  {len(a):4d} x  {sum(a) / len(a):6.2f} us  {name[:80]}")
    # the engine's decode graph: K steps of forward + sampling + advance; per step, what is not the forward's
    step_keys = sorted((k for k in graphs.step_graphs if k[0] == size), key=lambda k: -k[1])  # the most steps first
    if step_keys:
        (_, steps, *_), forward_names = step_keys[0], set(adds)
        step_last, step_adds = replay_kernels(graphs.step_graphs[step_keys[0]][0])
        span = max(e for _, e, _ in step_last) - step_last[0][0]
        rest = {n: a for n, a in step_adds.items() if n not in forward_names}
        print(f"B={batch} decode graph ({steps} steps per replay): {span / steps:.1f} us per step; kernels whose "
              f"names the forward graph lacks add {sum(sum(a) for a in rest.values()) / steps:.1f} us per step:")
        for name, a in sorted(rest.items(), key=lambda kv: -sum(kv[1]))[:12]:
            print(f"   {sum(a) / steps:7.1f} us/step added  {len(a) / steps:4.1f} x/step  {name[:80]}")
        # the first step's hand-over: its last forward kernels, the sampler, the next step's first kernels
        first = next((i for i, (_, _, n) in enumerate(step_last) if n not in forward_names), None)
        if first is not None:
            base = step_last[first - 1][0]
            print("the first step's lm_head, sampling and the next step's first kernels (us from the lm_head's start):")
            for start, end, name in step_last[max(first - 2, 0):first + 4]:
                print(f"   start {start - base:7.2f}  dur {end - start:6.2f}  end {end - base:7.2f}  {name[:70]}")
    per_layer = len(last) // layers
    mid = per_layer * (layers // 2)
    print(f"one layer (kernels {mid}..{mid + per_layer - 1} of the replay; us from the layer's first start):")
    base = last[mid][0]
    for start, end, name in last[mid:mid + per_layer + 1]:
        print(f"   start {start - base:7.2f}  dur {end - start:6.2f}  end {end - base:7.2f}  {name[:70]}")


def replay_kernels(graph: torch.cuda.CUDAGraph) -> tuple[list[tuple[float, float, str]], dict[str, list[float]]]:
    """One replay's kernels as the profiler saw them, (start us, end us, name) in start order, and per name the
    chain time each launch added (its end minus the latest end before it; these add up to the replay's span)."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA"), key=lambda k: k[0])
    last = kernels[-(len(kernels) // 3):]
    adds: dict[str, list[float]] = {}
    prev_end = last[0][0]
    for start, end, name in last:
        adds.setdefault(name, []).append(max(end - prev_end, 0.0))
        prev_end = max(prev_end, end)
    return last, adds


if __name__ == "__main__":
    main()
