#!/usr/bin/env bash
# Session 16 (~4 min on an H200): the add + RMSNorm before the batched router folded into `_router_topk`, A/B on the
# decode forward graph at B=128 (off, on, off, on), then the router tests on CUDA.
# Run from the repository root with the project importable.
set -u
for fold in off on off on; do
  echo "MOELOOP_ROUTER_NORM_FOLD=$fold"
  MOELOOP_ROUTER_NORM_FOLD=$fold timeout 60 python3 benchmarks/profile_decode.py --batch 128 --top 0 --steps 10 2>&1 \
      | grep -E "forward graph|Error" | grep -v -i warn
done
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_rollout_fused_decode.py -k "router" 2>&1 | tail -2
