#!/usr/bin/env bash
# The second device call (~6 min on an H200): session 9's three B=1 changes, each on by default with a switch, as
# an A/B on "forward graph alone" (profile_decode.py) after their CUDA tests: the early PDL trigger
# (MOELOOP_PDL_EARLY), gate_up's expert prediction + weight preload (MOELOOP_GATE_UP_PRELOAD) and the paged
# decode's K/V preload (MOELOOP_KV_PRELOAD); then the rollout benchmark at every batch size (the K/V preload
# applies at every batch size).
# Session 8's version measured the L2 prefetch experiment (removed; BENCHMARKS.md, session 9).
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_rollout_paged_attention.py \
    tests/test_rollout_cuda.py tests/test_rollout_multistep.py --tb=short 2>&1 \
    | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20
timeout 90 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -24
for off in MOELOOP_PDL_EARLY MOELOOP_GATE_UP_PRELOAD MOELOOP_KV_PRELOAD ALL NONE; do
    echo "off: $off"
    if [ "$off" = ALL ]; then
        env MOELOOP_PDL_EARLY=off MOELOOP_GATE_UP_PRELOAD=off MOELOOP_KV_PRELOAD=off timeout 60 \
            python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep "forward graph"
    else
        env "$off=off" timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep "forward graph"
    fi
done
timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 2 --skip-hf \
    2>&1 | grep -v -i warn | tail -5
