#!/usr/bin/env bash
# The second device call (~3 min on an H200): where the B=1 decode step's time goes after session 10, whose folds
# (q/k into attention, split merge, router top-k: all slower) are in BENCHMARKS.md, sessions 9-10, and whose kept
# changes (the fused top-k sampler, the RoPE table) are measured there.
# 1. The sampler alone, per step in CUDA graphs, and its agreement with the torch path (`benchmarks/sampler.py`).
# 2. The B=1 forward graph's timeline and the decode graph's extra kernels (`profile_decode.py --timeline`).
# 3. B=1 decode with 5 repeats and the engine.step spread (two runs of 2 repeats printed 29.5% and 38.8%).
# Run from the repository root with the project importable.
set -u
timeout 150 python3 benchmarks/sampler.py 2>&1 | tail -8
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -45
timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 --skip-hf --step-times \
    2>&1 | grep -v -i warn | tail -3
