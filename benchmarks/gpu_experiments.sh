#!/usr/bin/env bash
# The second device call (~4 min on an H200): session 7's B=1 experiments, both off by default and not yet run on a
# GPU. MOELOOP_NORM_FOLD=on folds the add + RMSNorm into the next one-token projection (`_norm_row_linear`);
# MOELOOP_TOPK_FOLD=on lets the few-token expert kernels route from the router logits (no `_softmax_topk` launch).
# Each shortens the B=1 forward graph or not: compare "forward graph alone" with gpu_first_call.sh's B=1 line.
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_topk_fold.py --tb=short \
    2>&1 | tail -3
timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 3 | grep "^B=1"  # the baseline, same machine
for flags in "--norm-fold" "--topk-fold" "--norm-fold --topk-fold"; do
    echo "profile_decode $flags"; timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 3 $flags | grep "^B=1"
done
MOELOOP_NORM_FOLD=on MOELOOP_TOPK_FOLD=on timeout 60 python3 benchmarks/rollout.py --device cuda --size reference \
    --batch 1 --repeats 2 --skip-hf | tail -1
