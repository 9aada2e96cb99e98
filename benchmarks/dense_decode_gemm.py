"""The batched decode's dense projections at the reference shape: cuBLAS (F.linear) against `fused_decode.dense_gemm`
(a Triton launch that can join the decode's PDL chain), per tile, with and without PDL, next to the copy bandwidth.

Each timing is a CUDA graph of LAUNCHES launches cycling over COPIES copies of the weight (more than the L2 holds),
replayed back to back: microseconds per launch, the weight bytes over that time, and the share of copy bandwidth.

    python3 benchmarks/dense_decode_gemm.py [--tokens 32,128,256] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from cuda_kernels import replay_seconds
from moeloop.model import kernel_switch
from moeloop.rollout import fused_decode
from rollout import copy_bandwidth_bytes_per_s

SHAPES = {"q|k|v": (2560, 1536), "o_proj": (1536, 1536)}  # (N, K) of the reference Qwen3-MoE
LAUNCHES, COPIES = 48, 16


def launch_us(fn, x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    """Microseconds per launch of fn(x, w) over the weight copies, in one captured graph (median of 5 timings)."""
    fn(x, ws[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            fn(x, ws[i % COPIES])
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(replay_seconds(graph, 10) for _ in range(5)) / LAUNCHES * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,128,256")
    ap.add_argument("--sweep", action="store_true", help="every tile of BLOCK_N 16/32/64, BLOCK_K 64/128/256, 4 "
                                                         "warps, 3/4 stages (default: DENSE_TILE only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth_bytes_per_s("cuda")
    default = fused_decode.DENSE_TILE
    tiles = [default]
    if args.sweep:
        tiles += [t for t in itertools.product([16, 32, 64], [64, 128, 256], [4], [3, 4]) if t != default]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s "
          f"(read+write); bf16; {LAUNCHES} launches over {COPIES} weight copies per graph")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, 1536, device="cuda", dtype=torch.bfloat16)
        for name, (N, K) in SHAPES.items():
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            nbytes = N * K * 2

            def row(label: str, us: float) -> str:
                return f"  {label:42s} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  {100 * nbytes / us / 1e-6 / bw:5.1f}% copy"

            ref = F.linear(x, ws[0])
            print(f"T={T} {name} [{N}, {K}] ({nbytes / 1e6:.1f} MB):")
            print(row("cuBLAS F.linear", launch_us(F.linear, x, ws)))
            results = []
            for tile, pdl_rows in itertools.product(tiles, (0, 256)):
                kernel_switch.PDL_MAX_ROWS = pdl_rows
                try:
                    us = launch_us(lambda a, w: fused_decode.dense_gemm(a, w, tile), x, ws)
                except Exception as err:  # noqa: BLE001 (a tile that does not fit: shared memory, registers)
                    print(f"  tile {tile}: {type(err).__name__}")
                    continue
                diff = (fused_decode.dense_gemm(x, ws[0], tile).float() - ref.float()).abs().max().item()
                results.append((us, tile, pdl_rows > 0, diff))
            kernel_switch.PDL_MAX_ROWS = 8
            for us, tile, pdl, diff in sorted(results)[:6]:
                print(row(f"dense_gemm {tile}{' PDL' if pdl else ''}", us) + f"  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
