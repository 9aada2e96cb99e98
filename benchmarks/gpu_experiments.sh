#!/usr/bin/env bash
# The second device call (~5 min on an H200), two things not yet run on a GPU (session 9):
# 1. The q/k fold (MOELOOP_QK_FOLD=on, off by default): the q/k norm, RoPE and the new k/v's cache store inside the
#    paged attention kernel for decode batches of up to 8 rows (one launch fewer per layer; the q/k norm + RoPE
#    kernel added 1.4 us per layer at B=1). Its CUDA tests, then "forward graph alone" at B=1 off/on/off/on; turn it
#    on only if the graph shrinks and the tests pass.
# 2. Where B=1's time goes now: the forward graph's timeline and (new) the engine's K-step decode graph, its time
#    per step against the forward graph's (0.49 ms vs 0.419 ms) and the kernels its sampling adds.
# Earlier versions: session 8's L2 prefetch, session 9's gate_up and K/V preloads (removed), the early PDL trigger
# and V read with K (kept); BENCHMARKS.md, session 9.
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py -k "qk_fold or pdl or single_sequence" \
    --tb=short 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -12
for fold in off on off on; do
    echo "MOELOOP_QK_FOLD=$fold"
    MOELOOP_QK_FOLD=$fold timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep "forward graph"
done
MOELOOP_QK_FOLD=on timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,8 --repeats 2 \
    --skip-hf 2>&1 | grep -v -i warn | tail -3
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -45
