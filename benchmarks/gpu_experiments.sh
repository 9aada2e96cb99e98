#!/usr/bin/env bash
# The second device call (~3 min on an H200): the B=1 decode after session 12 (tiles measured in place, the lm_head
# fold; the merge, even-chunk and rope folds that lost are in BENCHMARKS.md, session 12).
# 1. The tiles and folds in place (`b1_tiles.py`): one knob at a time, two rounds, greedy tokens compared with the
#    defaults', then each changed knob against the defaults in alternation.
# 2. The B=1 forward graph's timeline and the decode graph's extra kernels (defaults).
# 3. B=1 decode with 5 repeats (each wall the fastest) and the engine.step spread (defaults).
# A knob that wins its A/B becomes the module default, then 2 and 3 are run again.
# Run from the repository root with the project importable.
set -u
timeout 300 python3 benchmarks/b1_tiles.py --rounds 2 2>&1 | grep -v -i warn | tail -50
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | tail -32
timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 --skip-hf --step-times \
    2>&1 | grep -v -i warn | tail -3
