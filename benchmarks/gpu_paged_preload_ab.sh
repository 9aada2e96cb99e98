#!/usr/bin/env bash
# One device call (about 7 min on an H200): the paged decode's split programs reading their first block of cached
# K/V before the PDL wait (`decode_kernel.PAGED_PRELOAD`, MOELOOP_PAGED_PRELOAD=off: after it) against after. First
# the decode tests on CUDA, then B=1 decode (`rollout.py`) in alternation (ROUNDS rounds, default 2), then B=32 and
# 256 with the preload (B=32 runs split programs too; B=256 one program per row, unchanged).
# Run from the repository root with the project importable; logs under $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_paged_attention.py \
    tests/test_rollout_fused_decode.py --tb=short > "$out/preload_tests.log" 2>&1
grep -E "^(FAILED|ERROR|E  )" "$out/preload_tests.log" | head -20
tail -1 "$out/preload_tests.log"
b() {  # label, batches, then env assignments
    local label=$1 batches=$2; shift 2
    echo "== $label"
    env "$@" timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch "$batches" --repeats 3 \
        --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| [0-9]+ "
}
for round in $(seq "${ROUNDS:-2}"); do
    b "K/V after the wait" 1 MOELOOP_PAGED_PRELOAD=off
    b "first block before the wait" 1 MOELOOP_PAGED_PRELOAD=on
done
b "first block before the wait, B=32 and 256" 32,256 MOELOOP_PAGED_PRELOAD=on
