"""The batched decode's router + softmax top-k kernel (`fused_decode._router_topk`, one launch per layer from 16
tokens up) at the reference shape, per tile and number of column splits per token tile (`ROUTER_TOPK_SPLITS`): GPU
time of one launch (50 launches captured in a CUDA graph, replayed back to back), and its ids/weights compared with
the default's.

    python3 benchmarks/router_topk.py [--tokens 32,128,256] [--splits 1,2,3,4,6,12]
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
    ap.add_argument("--splits", default="1", help="ROUTER_TOPK_SPLITS values to sweep with every tile")
    ap.add_argument("--tiles", choices=["all", "default", "few"], default="all",
                    help="all: BLOCK_T 16/32 x BLOCK_D 128/256/512 x 4/8 warps x 2-4 stages; few: BLOCK_T 16, "
                         "BLOCK_D 128/256, 4 warps, 2-3 stages; default: ROUTER_TOPK_TILE alone")
    args = ap.parse_args()
    torch.manual_seed(0)
    gate = SimpleNamespace(weight=torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * 0.02, top_k=K,
                           routed_scaling_factor=1.0, norm_topk_prob=True, scoring_func="softmax")
    moe = SimpleNamespace(gate=gate)
    default = (fused_decode.ROUTER_TOPK_TILE, fused_decode.ROUTER_TOPK_SPLITS)
    grid = {"all": ([16, 32], [128, 256, 512], [4, 8], [2, 3, 4]), "few": ([16], [128, 256], [4], [2, 3]),
            "default": ([], [], [], [])}[args.tiles]
    shapes = [default[0]] + [t for t in itertools.product(*grid) if t != default[0]]
    tiles = [default] + [(t, s) for t in shapes for s in (int(x) for x in args.splits.split(",")) if (t, s) != default]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; _router_topk, D={D}, E={E}, top-{K}, bf16")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        fused_decode.ROUTER_TOPK_TILE, fused_decode.ROUTER_TOPK_SPLITS = default
        ref = fused_decode.route(moe, x)
        rows = []
        for tile in tiles:
            fused_decode.ROUTER_TOPK_TILE, fused_decode.ROUTER_TOPK_SPLITS = tile
            try:
                us = launch_us(moe, x)
            except Exception as err:  # noqa: BLE001 (a tile that does not fit: shared memory, registers)
                print(f"T={T} tile {tile}: {type(err).__name__}")
                continue
            ids, wts = fused_decode.route(moe, x)
            rows.append((us, tile, torch.equal(ids, ref[0]), (wts - ref[1]).abs().max().item()))
        fused_decode.ROUTER_TOPK_TILE, fused_decode.ROUTER_TOPK_SPLITS = default
        base = next(r for r in rows if r[1] == default)
        print(f"T={T}: default {default} {base[0]:.2f} us; fastest:")
        for us, tile, same, dw in sorted(rows)[:6]:
            print(f"   {us:6.2f} us  (BLOCK_T, BLOCK_D, warps, stages)={tile[0]} splits {tile[1]}  same ids {same}, "
                  f"max weight diff {dw:.1e}")


if __name__ == "__main__":
    main()
