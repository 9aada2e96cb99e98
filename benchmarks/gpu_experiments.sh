#!/usr/bin/env bash
# The second device call (~3 min on an H200): the B=1 L2 prefetch experiment (MOELOOP_L2_PREFETCH=on, off by
# default, not yet run on a GPU): its CUDA test (bitwise-equal decode), "forward graph alone" at B=1 without and
# with it (turn it on only if the graph shrinks), and rollout.py's B=1 line with it.
# Session 8's version of this script ran the DP=2 over NCCL test (its cuda case needs 2 GPUs):
#   python3 -m pytest -q -s tests/test_dp_torchrun.py
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py -k "l2_prefetch or single_sequence" \
    --tb=short 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -12
for pf in off on off on; do
    echo "MOELOOP_L2_PREFETCH=$pf"
    MOELOOP_L2_PREFETCH=$pf timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 4 | grep -v -i warn | tail -5
done
MOELOOP_L2_PREFETCH=on timeout 60 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 \
    --repeats 2 --skip-hf | tail -1
