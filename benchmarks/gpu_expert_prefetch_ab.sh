#!/usr/bin/env bash
# One device call (about 8 min on an H200, by the earlier A/B scripts' timings): the speculative expert prefetch at
# B=1 (`rollout.expert_prefetch`: MOELOOP_EXPERT_PREFETCH=S experts per layer, MOELOOP_EXPERT_PREFETCH_DOWN=on for
# their down rows too) against none. First its tests (the CUDA one checks that outputs do not change), then B=1
# decode (`rollout.py`, walls in alternation: 0, 6, 8, 6 + down; ROUNDS=2 repeats them, too long for one call), one
# B=1 run with RL's unfiltered sampling (`--top-k 0`) for reference, then the decode graph's timeline with 6 and
# with none.
# Run from the repository root with the project importable; logs under $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_expert_prefetch.py tests/test_rollout_fused_decode.py \
    --tb=short > "$out/prefetch_tests.log" 2>&1
grep -E "^(FAILED|ERROR|E  )" "$out/prefetch_tests.log" | head -20
tail -1 "$out/prefetch_tests.log"
b1() {  # label, then env assignments
    local label=$1; shift
    echo "== $label"
    env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 3 --skip-hf \
        --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 "
}
for round in $(seq "${ROUNDS:-1}"); do
    b1 "no prefetch" MOELOOP_EXPERT_PREFETCH=0
    b1 "prefetch 6 experts (gate_up)" MOELOOP_EXPERT_PREFETCH=6
    b1 "prefetch 8 experts (gate_up)" MOELOOP_EXPERT_PREFETCH=8
    b1 "prefetch 6 experts (gate_up + down)" MOELOOP_EXPERT_PREFETCH=6 MOELOOP_EXPERT_PREFETCH_DOWN=on
done
echo "== RL sampling (no top-k filter), no prefetch, for reference (the goal's row keeps top-k 50)"
timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 3 --skip-hf --step-times \
    --top-k 0 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 "
for s in 6 0; do
    echo "== timeline, MOELOOP_EXPERT_PREFETCH=$s"
    MOELOOP_EXPERT_PREFETCH=$s timeout 90 python3 benchmarks/profile_decode.py --batch 1 --top 12 --timeline 2>&1 \
        | grep -v -i warn | tail -25
done
