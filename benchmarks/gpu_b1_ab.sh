#!/usr/bin/env bash
# One device call (~6 min on an H200): the CUDA tests of the sampler and decode paths; the sampler with the fixed-
# length bisections (MOELOOP_TOPK_SHORT=off) against the default short ones (stop once the range is one key, phase 2
# from the full slices' bound); then B=1 decode (`rollout.py`, 5 repeats, walls in alternation) the same two ways,
# twice; then the decode graph's timeline (defaults). Session 14 ran it when the short bisections were still off by
# default (BENCHMARKS.md, session 14, item 1); session 13 ran its first version (the tail step counts, the
# sampler's record and PDL).
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampler.py tests/test_rollout_cuda.py \
    tests/test_rollout_fused_decode.py --tb=short > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -30
tail -1 /tmp/gpu_tests.log
for short in on off; do
    echo "== sampler, MOELOOP_TOPK_SHORT=$short"
    MOELOOP_TOPK_SHORT=$short timeout 150 python3 benchmarks/sampler.py 2>&1 | tail -7
done
source "$(dirname "$0")/gpu_lib.sh"  # b1
b1 "defaults" X=1
b1 "fixed-length bisections" MOELOOP_TOPK_SHORT=off
b1 "defaults" X=1
b1 "fixed-length bisections" MOELOOP_TOPK_SHORT=off
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | grep -A4 "decode graph"
