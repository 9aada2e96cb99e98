#!/usr/bin/env bash
# Session 24's device calls. Run from the repository root with the project importable. early and hold need commit
# 82d078e (QK_EARLY was removed after these runs); late needs c469570 (MOELOOP_LATE_TRIGGERS, removed after its run);
# next needs e6a0106 (EXPERT_READS_EARLY and PAGED_HEADS, removed after its run in session 25).
#   early: (nvidia-h200) MOELOOP_QK_EARLY=on: the q/k norm launch of every layer after the first triggers early, and
#          its paged decode reads the cached K/V before its wait and triggers late. The CUDA decode tests with it
#          on, then B=1 A/B in alternation (2 rounds): defaults, the trigger alone (MOELOOP_PAGED_PRELOAD=off), both;
#          then one layer's timeline with both.
#   hold:  (nvidia-h200) MOELOOP_QK_EARLY=on with the trigger held by the paged decode, its merge, or neither (o_proj
#          then reads its residual after its wait): B=1 A/B against the defaults, 2 rounds; a timeline with "oproj".
#   late:  (nvidia-h200) MOELOOP_LATE_TRIGGERS: the expert down kernel triggering late (the next q|k|v launch's
#          weight reads no longer overlap gate_up), 3 rounds against the defaults; o_proj, q|k|v late once each.
#   tiles: (nvidia-h200) `b1_tiles.py` over the gate_up, down, row_linear, lm_head tiles and the paged decode's warps
#          at today's code, one round, the best against the defaults in alternation.
#   next:  (nvidia-h200; prepared for session 25, about 9 minutes) MOELOOP_EXPERT_READS_EARLY=on (gate_up reads the
#          token's row with the logits; down reads its weights before its 1 / RMS and routing weights) and
#          MOELOOP_PAGED_HEADS=on|early (one-row split programs per query head in plain multiply-adds): CUDA tests,
#          b1_tiles A/Bs (and the paged knobs, merge warps and lm_head tile re-swept at 8 warps), then B=1 engine.step
#          in alternation.
#   slots: (nvidia-h200; prepared for session 25, about 5 minutes) MOELOOP_TOPK_READS_EARLY=on (the top-k draw's
#          phase 2 reads every candidate slot with the counts, and the slices' maxima and sums, before its first
#          reduction): the sampler's CUDA tests, `sampler.py` alone off and on, then B=1 engine.step in alternation
#          (the sampler is not in b1_tiles' forward graph).
set -u
source "$(dirname "$0")/gpu_lib.sh"  # b1
case "${1:-}" in
early)
    MOELOOP_QK_EARLY=on timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_paged_attention.py \
        tests/test_rollout_fused_decode.py --tb=short -k "first_block or qk_early or single_sequence or pdl or bf16" \
        2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2; do
        b1 "defaults" X=1
        b1 "qk early, trigger only" MOELOOP_QK_EARLY=on MOELOOP_PAGED_PRELOAD=off
        b1 "qk early, K/V before the wait" MOELOOP_QK_EARLY=on
    done
    MOELOOP_QK_EARLY=on timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
        | grep -v -i warn | grep -A10 "one layer"
    ;;
hold)  # MOELOOP_QK_EARLY=on with each launch that holds its trigger (MOELOOP_QK_EARLY_HOLD), 2 rounds
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py --tb=short \
        -k "qk_early or composed" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2; do
        b1 "defaults" X=1
        for hold in paged merge oproj; do b1 "qk early, hold: $hold" MOELOOP_QK_EARLY=on MOELOOP_QK_EARLY_HOLD=$hold; done
    done
    MOELOOP_QK_EARLY=on MOELOOP_QK_EARLY_HOLD=oproj timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 \
        --timeline 2>&1 | grep -v -i warn | grep -A10 "one layer"
    ;;
late)  # launches that trigger late instead of early (MOELOOP_LATE_TRIGGERS), alternating with the defaults
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_kernel_switch.py \
        --tb=short -k "pdl or single_sequence or late_triggers" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2 3; do
        b1 "defaults" X=1
        b1 "late: down" MOELOOP_LATE_TRIGGERS=down
    done
    b1 "late: o_proj" MOELOOP_LATE_TRIGGERS=o_proj
    b1 "late: qkv" MOELOOP_LATE_TRIGGERS=qkv
    ;;
tiles)  # the B=1 tiles re-swept at today's code (composed router, q/k preload): forward graph, one round
    timeout 330 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 2 --knobs gate_up,down,row_linear,lm_head,paged_warps \
        2>&1 | grep -v -i warn
    ;;
next)  # built in session 24, not yet run: see the header
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_paged_attention.py \
        tests/test_rollout_fused_decode.py --tb=short -k "per_head or paged_heads or one_row or composed or o_proj_router or routed_experts" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    timeout 200 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 2 --knobs paged_block_n,max_splits,paged_stages,merge_warps,lm_head \
        --ab "expert_reads_early=True" --ab "paged_heads='on'" --ab "paged_heads='early'" \
        --ab "paged_heads='early';paged_heads_warps=8" \
        2>&1 | grep -v -i warn
    for round in 1 2; do
        b1 "defaults" X=1
        b1 "expert reads early" MOELOOP_EXPERT_READS_EARLY=on
        b1 "paged heads, slots early" MOELOOP_PAGED_HEADS=early
    done
    ;;
slots)  # built in session 24, not yet run: see the header
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampler.py --tb=short -k "topk or gumbel" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for mode in off on; do
        echo "== sampler.py, MOELOOP_TOPK_READS_EARLY=$mode"
        MOELOOP_TOPK_READS_EARLY=$mode timeout 150 python3 benchmarks/sampler.py 2>&1 | grep -v -i warn | tail -7
    done
    for round in 1 2; do
        b1 "defaults" X=1
        b1 "top-k reads early" MOELOOP_TOPK_READS_EARLY=on
    done
    ;;
*) echo "usage: $0 early|hold|late|tiles|next|slots" >&2; exit 2 ;;
esac
