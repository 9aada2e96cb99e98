#!/usr/bin/env bash
# The second device call (~5 min on an H200): session 10's decode folds, not yet run on a GPU when written.
# 1. MOELOOP_MERGE_FOLD (on): the paged decode's last split program of each (row, kv head) merges the splits
#    (`decode_kernel.last_arrival` on `KVCache.arrivals`), no `_merge_splits` launch.
# 2. MOELOOP_ROUTE_FOLD (on): at B=1 the router projection's last program runs the softmax + top-k, no
#    `_softmax_topk` launch.
# Their CUDA tests, then "forward graph alone" at B=1 with each off and both on (twice, interleaved), the rollout
# benchmark at B=1, 32, 256 and the B=1 timeline (forward graph kernels, the decode graph's sampler kernels).
# Earlier experiments: BENCHMARKS.md, sessions 8-10 (the q/k fold into the attention kernel measured slower).
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_rollout_paged_attention.py \
    tests/test_rollout_sampler.py --tb=short 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -12
for round in 1 2; do
    for env in "MOELOOP_MERGE_FOLD=on" "MOELOOP_MERGE_FOLD=off" "MOELOOP_ROUTE_FOLD=off"; do
        echo "$env: $(env $env timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep 'forward graph')"
    done
done
timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 2 --skip-hf \
    2>&1 | grep -v -i warn | tail -4
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -45
