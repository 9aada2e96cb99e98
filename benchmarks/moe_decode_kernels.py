"""Decode-time routed experts of one MoE layer (reference Qwen3-MoE: 64 experts top-4, D 1536, F 512, bf16):
the engine's grouped path with its Triton expert GEMMs vs with torch's grouped_mm, and the HBM ceiling, in one run.

    python benchmarks/moe_decode_kernels.py --batch 32,128,256 [--sweep]

Each variant is captured in a CUDA graph of 20 calls and replayed (GPU time, no launch gaps). Bytes per call =
distinct experts touched x 3*D*F*2 + activations; "% copy" = that over the measured device-to-device copy
bandwidth. `--slack` times the M-tile rule; `--sweep` also times the `_expert_gemm` tile choices (BLOCK_N, BLOCK_K, warps, stages).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from cuda_kernels import captured, replay_seconds
from moeloop.model.experts import Experts
from moeloop.rollout import moe_kernel


def copy_bandwidth() -> float:
    x = torch.empty(2**29, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (start.elapsed_time(end) / 1e3)


def graph_time(fn, calls: int = 20, replays: int = 10) -> float:
    """Seconds per call from CUDA-graph replays."""
    g, _ = captured(lambda: [fn() for _ in range(calls)], warmups=1)
    g.replay()
    torch.cuda.synchronize()
    return replay_seconds(g, replays) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="32,128,256")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--sweep", action="store_true", help="also time the tile choices")
    ap.add_argument("--slack", default="1,2,4", help="BLOCK_M_SLACK values to time (M tile = slack x mean rows/expert)")
    args = ap.parse_args()
    E, K, D, F = args.experts, args.top_k, args.dim, args.ffn
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device copy bandwidth {bw / 1e12:.2f} TB/s")
    torch.manual_seed(0)
    experts = Experts(E, D, F, "grouped_mm").cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    for B in [int(b) for b in args.batch.split(",")]:
        x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(B, E, device="cuda").topk(K, dim=-1).indices
        wts = torch.rand(B, K, device="cuda").softmax(-1)
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * D * F * 2 + B * D * 2 * 2 + B * K * (F + D) * 2 * 2
        ref = moe_kernel.grouped_experts(experts, x, ids, wts, "grouped_mm")
        got = moe_kernel.grouped_experts(experts, x, ids, wts, "triton")
        err = float((got.float() - ref.float()).abs().max())
        print(f"B={B}: {B * K} assignments over {touched} experts, {nbytes / 1e6:.1f} MB/call; "
              f"max |triton - grouped_mm| = {err:.2e}")
        with torch.no_grad():
            for gemm in ("grouped_mm", "triton"):
                t = graph_time(lambda: moe_kernel.grouped_experts(experts, x, ids, wts, gemm))
                print(f"  {gemm:>10}: {t * 1e6:7.1f} us/call, {nbytes / t / 1e12:.2f} TB/s = {100 * nbytes / t / bw:.1f}% copy")
            saved_slack = moe_kernel.BLOCK_M_SLACK
            for slack in [int(v) for v in args.slack.split(",")]:
                moe_kernel.BLOCK_M_SLACK = slack
                t = graph_time(lambda: moe_kernel.grouped_experts(experts, x, ids, wts, "triton"))
                print(f"    triton, BLOCK_M_SLACK={slack}: {t * 1e6:7.1f} us/call, {100 * nbytes / t / bw:.1f}% copy")
            moe_kernel.BLOCK_M_SLACK = saved_slack
            if args.sweep:
                saved = moe_kernel.GATE_UP_TILE, moe_kernel.DOWN_TILE
                results = []
                for tile in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
                    try:
                        moe_kernel.GATE_UP_TILE = tile
                        tg = graph_time(lambda: moe_kernel.grouped_experts(experts, x, ids, wts, "triton"))
                        moe_kernel.GATE_UP_TILE = saved[0]
                        moe_kernel.DOWN_TILE = tile
                        td = graph_time(lambda: moe_kernel.grouped_experts(experts, x, ids, wts, "triton"))
                        moe_kernel.DOWN_TILE = saved[1]
                        results.append((tile, tg, td))
                    except Exception as exc:  # noqa: BLE001 (a tile that does not fit: report and go on)
                        moe_kernel.GATE_UP_TILE, moe_kernel.DOWN_TILE = saved
                        print(f"    tile {tile}: {type(exc).__name__}")
                for label, idx in (("gate_up", 1), ("down", 2)):
                    best = sorted(results, key=lambda r: r[idx])[:4]
                    print(f"  best {label} tiles (BLOCK_N, BLOCK_K, warps, stages) -> us/call of the whole path: " +
                          ", ".join(f"{r[0]} {r[idx] * 1e6:.1f}" for r in best))


if __name__ == "__main__":
    main()
