#!/usr/bin/env bash
# A/B of the routed experts in one launch (`MOELOOP_MOE_ONE_LAUNCH`: gate_up, a grid barrier, down): its CUDA tests,
# the B=1 forward graph in alternation with the two-launch default (`b1_tiles.py`, tokens compared), the one-launch
# timeline, then B=1 decode off / on in alternation.
set -u
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
    -k "one_launch or pdl or routed or single_sequence" 2>&1 | tail -2
timeout 240 python3 benchmarks/b1_tiles.py --rounds 0 --pairs 3 --ab one_launch=True \
    --ab "one_launch=True;one_prefetch=False" --ab "one_launch=True;one_down_rows=4" \
    --ab "one_launch=True;one_down_rows=16" 2>&1 | grep -v -i warn
MOELOOP_MOE_ONE_LAUNCH=on timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
    | grep -v -i warn | head -30
for m in on off on off; do
    echo "== MOELOOP_MOE_ONE_LAUNCH=$m"
    MOELOOP_MOE_ONE_LAUNCH=$m timeout 60 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 \
        --repeats 3 --skip-hf --step-times 2>&1 | grep -E "engine.step|^\| 1 |refused"
done
