#!/usr/bin/env bash
# The second device call (~2 min on an H200): where B=1's time goes now. The forward graph's timeline, one middle
# layer, and (new, not yet run) the engine's K-step decode graph: its time per step against the forward graph's,
# and the kernels it adds (sampling, logprobs, the record/advance kernel). The step is ~70 us longer than the
# forward graph (0.49 ms vs 0.419 ms, session 9); this says where that goes.
# Earlier versions: session 8's L2 prefetch, session 9's gate_up and K/V preloads (removed), the early PDL trigger
# and V read with K (kept); BENCHMARKS.md, session 9.
# Run from the repository root with the project importable.
set -u
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -45
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline --top-k -1 2>&1 | grep -v -i warn \
    | grep -A14 "decode graph"
