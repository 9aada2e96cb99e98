#!/usr/bin/env bash
# The second device call (~6 min on an H200): where the B=1 decode step's time goes after session 11 (route and
# embedding folds on: eight kernels per layer; the L2 prefetch measured and removed, see BENCHMARKS.md).
# 0. The one-token kernels' tiles in place (`b1_tiles.py`, new in session 11, not yet run): one knob at a time.
# 1. The folds' switches, A/B on the forward graph alone (`profile_decode.py`), twice.
#      MOELOOP_ROUTE_FOLD  the expert kernels rank the router logits themselves: no top-k launch
#      MOELOOP_EMBED_FOLD  layer 0's q|k|v launch reads the embedding row: no lookup launch
# 2. The B=1 forward graph's timeline and the decode graph's extra kernels.
# 3. B=1 decode with 5 repeats and the engine.step spread.
# Run from the repository root with the project importable.
set -u
timeout 240 python3 benchmarks/b1_tiles.py --rounds 2 2>&1 | grep -v -i warn | tail -40
ab() {  # label, then env assignments
    local label=$1; shift
    echo "$label: $(env "$@" timeout 90 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep -o 'forward graph alone.*')"
}
for round in 1 2; do
    ab "both on" MOELOOP_ROUTE_FOLD=on
    ab "ROUTE_FOLD off" MOELOOP_ROUTE_FOLD=off
    ab "EMBED_FOLD off" MOELOOP_EMBED_FOLD=off
done
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -32
timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 --skip-hf --step-times \
    2>&1 | grep -v -i warn | tail -3
