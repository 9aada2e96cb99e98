#!/usr/bin/env bash
# One device call (~6 min on an H200): the CUDA tests of the sampler and decode paths, then B=1 decode
# (`rollout.py`, 5 repeats, each wall the fastest) with session 13's switches all on (the defaults), all off, and
# each one off alone: MOELOOP_TAIL_STEP_COUNTS (the last r < K tokens in launches of K/2 .. 2 steps),
# MOELOOP_FUSED_RECORD (the sampler writes multi-step decode's record, no `_record_advance` launch),
# MOELOOP_SAMPLER_PDL (the one-launch samplers under PDL). Then the decode graph's timeline (defaults).
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampler.py tests/test_rollout_cuda.py \
    tests/test_rollout_fused_decode.py --tb=short > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -30
tail -1 /tmp/gpu_tests.log
b1() {  # label, then env assignments
    local label=$1; shift
    echo "== $label"
    env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 --skip-hf \
        --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 "
}
b1 "defaults (all on)" X=1
b1 "all off" MOELOOP_TAIL_STEP_COUNTS=off MOELOOP_FUSED_RECORD=off MOELOOP_SAMPLER_PDL=off
b1 "tail step counts off" MOELOOP_TAIL_STEP_COUNTS=off
b1 "fused record off" MOELOOP_FUSED_RECORD=off
b1 "sampler PDL off" MOELOOP_SAMPLER_PDL=off
b1 "defaults again" X=1
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | grep -A8 "decode graph"
