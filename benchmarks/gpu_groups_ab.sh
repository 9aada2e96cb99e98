#!/usr/bin/env bash
# A/B of the top-k sampler's group bound (`MOELOOP_TOPK_GROUPS`): the sampler alone off/on (its random batches
# check the kernels against the torch path), the sampler's CUDA tests (both phase-1 paths), then B=1 decode with it.
set -u
for g in off on; do
    echo "== MOELOOP_TOPK_GROUPS=$g"
    MOELOOP_TOPK_GROUPS=$g timeout 80 python3 benchmarks/sampler.py 2>&1 | grep -E "^B=|differ"
done
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampler.py -k "fused_topk or fused_top_p" 2>&1 \
    | tail -1
MOELOOP_TOPK_GROUPS=on timeout 60 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 3 \
    --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 "
