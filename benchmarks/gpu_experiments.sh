#!/usr/bin/env bash
# The second device call (~6 min on an H200): session 11's three B=1 changes, each with its switch, A/B on the
# forward graph alone (`profile_decode.py`), then the timeline and the B=1 rollout row with all three on.
#   MOELOOP_L2_NEXT     o_proj asks L2 for the next layer's q, k, v weights (per-thread prefetch, nothing waits)
#   MOELOOP_ROUTE_FOLD  the expert kernels rank the router logits themselves: no top-k launch
#   MOELOOP_EMBED_FOLD  layer 0's q|k|v launch reads the embedding row: no lookup launch
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_rollout_cuda.py --tb=short \
    > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -30
tail -1 /tmp/gpu_tests.log
ab() {  # label, then env assignments
    local label=$1; shift
    echo "$label: $(env "$@" timeout 90 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep -o 'forward graph alone.*')"
}
for round in 1 2; do
    ab "all on" MOELOOP_L2_NEXT=on
    ab "L2_NEXT off" MOELOOP_L2_NEXT=off
    ab "ROUTE_FOLD off" MOELOOP_ROUTE_FOLD=off
    ab "EMBED_FOLD off" MOELOOP_EMBED_FOLD=off
    ab "all off" MOELOOP_L2_NEXT=off MOELOOP_ROUTE_FOLD=off MOELOOP_EMBED_FOLD=off
done
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -32
timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 --skip-hf --step-times \
    2>&1 | grep -v -i warn | tail -3
