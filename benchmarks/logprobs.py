"""Peak memory and time of chunked vs naive token logprobs + entropy, forward + backward.

    python benchmarks/logprobs.py                      # CPU, T=8192 V=32000 D=1024
    python benchmarks/logprobs.py --device cuda --dtype bf16

Memory: on CUDA, torch.cuda.max_memory_allocated minus the allocation before the step (exact
allocator bytes). On CPU, each variant runs in a fresh subprocess and reports peak RSS
(getrusage ru_maxrss) minus the RSS just before the step: the inputs are already allocated then,
and glibc returns large (mmap'd) blocks to the OS on free, so the delta is the step's own peak
working set. It includes allocator slack, so it reads a little higher than tensor bytes.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from moeloop.model.logprobs import naive_token_logprobs, token_logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _step(variant: str, hidden, weight, labels, chunk_tokens: int) -> None:
    if variant == "naive":
        lp, ent = naive_token_logprobs(hidden, weight, labels)
    else:
        lp, ent = token_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens)
    (lp.sum() + 0.01 * ent.sum()).backward()


def measure(variant: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    hidden = torch.randn(args.tokens, args.dim, device=dev).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, device=dev) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    if dev.type == "cuda":
        _step(variant, hidden, weight, labels, args.chunk_tokens)  # warm-up (kernels, allocator)
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    _step(variant, hidden, weight, labels, args.chunk_tokens)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": variant, "peak_bytes": peak, "time_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", choices=["naive", "chunked"], help=argparse.SUPPRESS)  # subprocess mode
    args = p.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args)))
        return 0
    print(f"T={args.tokens} V={args.vocab} D={args.dim} chunk={args.chunk_tokens} dtype={args.dtype} "
          f"device={args.device} threads={torch.get_num_threads()}")
    print(f"full fp32 logits [T, V] alone: {args.tokens * args.vocab * 4 / 2**20:.0f} MiB")
    results = {v: _run(v, args, argv or sys.argv[1:]) for v in ("naive", "chunked")}
    for r in results.values():
        print(f"{r['variant']:>8}: peak {r['peak_bytes'] / 2**20:8.0f} MiB   fwd+bwd {r['time_s']:7.2f} s")
    n, c = results["naive"], results["chunked"]
    print(f"chunked/naive: peak memory {c['peak_bytes'] / n['peak_bytes']:.3f}x, time {c['time_s'] / n['time_s']:.2f}x")
    return 0


def _run(variant: str, args: argparse.Namespace, argv: list[str]) -> dict:
    if args.device.startswith("cuda"):
        return measure(variant, args)
    out = subprocess.run([sys.executable, __file__, *argv, "--only", variant],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
