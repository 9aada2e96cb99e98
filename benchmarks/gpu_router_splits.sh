#!/usr/bin/env bash
# Session 16 (~5 min on an H200): the batched router top-k with its hidden dim split over programs, alone (tiles x
# splits), then the decode forward graph at B=128/256 with 1, 3 and 6 splits, alternating.
# Run from the repository root with the project importable.
set -u
timeout 200 python3 benchmarks/router_topk.py --tokens 32,128,256 --splits 1,2,3,4,6,12 --tiles few 2>&1 | grep -v -i warn
for splits in 1 3 6 1 3 6; do
  echo "MOELOOP_ROUTER_SPLITS=$splits"
  MOELOOP_ROUTER_SPLITS=$splits timeout 100 python3 benchmarks/profile_decode.py --batch 128,256 --top 0 \
      --steps 10 2>&1 | grep -E "forward graph|Error" | grep -v -i warn
done
