#!/usr/bin/env bash
# A/B of gate_up's row as three unmasked chunks (`MOELOOP_GATE_UP_THIRDS`): how this Triton compiles it (registers,
# load order), its CUDA tests, the B=1 forward graph in alternation with the default (`b1_tiles.py`, tokens
# compared) at four tiles, then B=1 decode on / off in alternation.
set -u
timeout 60 python3 benchmarks/sass_order.py 2>&1 | grep -v -i warn
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
    -k "sorted_forward or single_sequence or pdl" 2>&1 | tail -1
timeout 200 python3 benchmarks/b1_tiles.py --rounds 0 --pairs 3 --ab gate_up_thirds=True \
    --ab "gate_up_thirds=True;gate_up=(8, 8)" --ab "gate_up_thirds=True;gate_up=(16, 8)" \
    --ab "gate_up_thirds=True;gate_up=(4, 4)" 2>&1 | grep -v -i warn
for m in on off on off; do
    echo "== MOELOOP_GATE_UP_THIRDS=$m"
    MOELOOP_GATE_UP_THIRDS=$m timeout 60 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 \
        --repeats 3 --skip-hf --step-times 2>&1 | grep -E "engine.step|^\| 1 "
done
