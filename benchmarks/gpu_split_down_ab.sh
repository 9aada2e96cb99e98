#!/usr/bin/env bash
# One device call (~7 min on an H200) for MOELOOP_SPLIT_DOWN (built in session 20, off by default, not yet
# measured: BENCHMARKS.md session 20, item 2): the CUDA tests of the fused decode with it on; B=1 decode
# (`rollout.py`, 5 repeats) with it off, on, and on with 16 rows per program (whole 32-byte sectors of down), twice,
# in alternation; B=8 (the most assignments the few-token kernels take at top-4) off and on once; then one layer's
# timeline with it on (its gate_up should end later and the partials' sum about 1.3 us after, against gate_up +7.6
# and down +2.85 us without).
# Run from the repository root with the project importable.
set -u
MOELOOP_SPLIT_DOWN=on python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
    tests/test_rollout_cuda.py --tb=short > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -30
tail -1 /tmp/gpu_tests.log
decode() {  # batch, label, then env assignments
    local batch=$1 label=$2; shift 2
    echo "== B=$batch $label"
    env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch "$batch" --repeats 5 \
        --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| $batch |walls"
}
decode 1 "defaults" MOELOOP_SPLIT_DOWN=off
decode 1 "split down" MOELOOP_SPLIT_DOWN=on
decode 1 "split down, 16 rows" MOELOOP_SPLIT_DOWN=on MOELOOP_SPLIT_DOWN_ROWS=16
decode 1 "defaults" MOELOOP_SPLIT_DOWN=off
decode 1 "split down" MOELOOP_SPLIT_DOWN=on
decode 1 "split down, 16 rows" MOELOOP_SPLIT_DOWN=on MOELOOP_SPLIT_DOWN_ROWS=16
decode 8 "defaults" MOELOOP_SPLIT_DOWN=off
decode 8 "split down" MOELOOP_SPLIT_DOWN=on
MOELOOP_SPLIT_DOWN=on timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
    | grep -v -i warn | tail -12
