"""The batched decode's router + softmax top-k kernel (`fused_decode._router_topk`, one launch per layer from 16
tokens up) at the reference shape, per tile: GPU time of one launch (50 launches captured in a CUDA graph, replayed
back to back), and its ids/weights compared with the default tile's.

    python3 benchmarks/router_topk.py [--tokens 32,128,256]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
from types import SimpleNamespace

import torch

from cuda_kernels import replay_seconds
from moeloop.rollout import fused_decode

D, E, K = 1536, 64, 4  # reference Qwen3-MoE: hidden, experts, top-k
LAUNCHES = 50


def launch_us(moe, x: torch.Tensor) -> float:
    """Microseconds per `route` launch, replayed in a graph of LAUNCHES launches (median of 5 timings)."""
    fused_decode.route(moe, x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fused_decode.route(moe, x)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(replay_seconds(graph, 20) for _ in range(5)) / LAUNCHES * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,128,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    gate = SimpleNamespace(weight=torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * 0.02, top_k=K,
                           routed_scaling_factor=1.0, norm_topk_prob=True, scoring_func="softmax")
    moe = SimpleNamespace(gate=gate)
    default = fused_decode.ROUTER_TOPK_TILE
    tiles = [default] + [t for t in itertools.product([16, 32], [128, 256, 512], [4, 8], [2, 3, 4]) if t != default]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; _router_topk, D={D}, E={E}, top-{K}, bf16")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        fused_decode.ROUTER_TOPK_TILE = default
        ref = fused_decode.route(moe, x)
        rows = []
        for tile in tiles:
            fused_decode.ROUTER_TOPK_TILE = tile
            try:
                us = launch_us(moe, x)
            except Exception as err:  # noqa: BLE001 (a tile that does not fit: shared memory, registers)
                print(f"T={T} tile {tile}: {type(err).__name__}")
                continue
            ids, wts = fused_decode.route(moe, x)
            rows.append((us, tile, torch.equal(ids, ref[0]), (wts - ref[1]).abs().max().item()))
        fused_decode.ROUTER_TOPK_TILE = default
        base = next(r for r in rows if r[1] == default)
        print(f"T={T}: default {default} {base[0]:.2f} us; fastest:")
        for us, tile, same, dw in sorted(rows)[:6]:
            print(f"   {us:6.2f} us  (BLOCK_T, BLOCK_D, warps, stages)={tile}  same ids {same}, max weight diff {dw:.1e}")


if __name__ == "__main__":
    main()
