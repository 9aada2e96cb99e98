#!/usr/bin/env bash
# Session 25's device calls. Run from the repository root with the project importable.
#   merge: (nvidia-h200) the split merge at 1 warp (MOELOOP_MERGE_WARPS=1; `b1_tiles.py` read +4.0 us per forward
#          in session 25's first call) and session 24's MOELOOP_TOPK_READS_EARLY=on: the sampler's CUDA tests,
#          `sampler.py` off and on, B=1 engine.step in alternation (3 rounds), then B=32 with the merge at 1 and 4.
#   final: (nvidia-h200, about 7 minutes) the code with both made default: their CUDA tests; `b1_tiles.py` A/Bs of the
#          lm_head tile (8, 8) and paged_block_n 32 (near the defaults in the first call's sweep); B=1 engine.step in
#          alternation against session 24's choices (merge 4 warps, top-k reads after the counts), 2 rounds; B=32 and
#          B=256 once.
#   oproj: (nvidia-h200, about 5 minutes) the composed router's o_proj launch with a tile of its own
#          (MOELOOP_O_PROJ_TILE; it shared q|k|v's ROW_LINEAR_TILE, which the sweeps varied jointly): its CUDA tests
#          at (8, 4), `b1_tiles.py` over o_proj and row_linear, then B=1 engine.step in alternation (2 rounds) with the
#          sweep's o_proj tile if it is not the default.
#   qkv:   (nvidia-h200; prepared for session 26, about 4 minutes) q|k|v's ROW_LINEAR_TILE at (8, 4)
#          (MOELOOP_ROW_LINEAR_TILE=8,4; `b1_tiles.py` read +1.8 us per forward in the oproj call): its CUDA tests, then
#          B=1 engine.step in alternation, 3 rounds.
#   sweep: (nvidia-h200; prepared for session 26, about 3 minutes) `b1_tiles.py` over row_linear (now with 16-row
#          tiles), o_proj (with 1- and 2-warp tiles) and lm_head (with 2-warp tiles): fewer warps won twice in session 25
#          (the merge, o_proj); gate_up and down again beside o_proj's new tile. Engine A/Bs of what it finds need a
#          second call.
set -u
source "$(dirname "$0")/gpu_lib.sh"  # b1
case "${1:-}" in
merge)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_sampler.py --tb=short -k "topk or gumbel" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    MOELOOP_MERGE_WARPS=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_paged_attention.py \
        --tb=short 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for mode in off on; do
        echo "== sampler.py, MOELOOP_TOPK_READS_EARLY=$mode"
        MOELOOP_TOPK_READS_EARLY=$mode timeout 150 python3 benchmarks/sampler.py 2>&1 | grep -v -i warn | tail -7
    done
    for round in 1 2 3; do
        b1 "defaults" X=1
        b1 "merge 1 warp" MOELOOP_MERGE_WARPS=1
        b1 "top-k reads early" MOELOOP_TOPK_READS_EARLY=on
    done
    for round in 1 2; do
        for w in 4 1; do
            echo "== B=32, merge $w warps"
            MOELOOP_MERGE_WARPS=$w timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 32 \
                --repeats 3 --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 32 |walls"
        done
    done
    ;;
final)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_paged_attention.py tests/test_rollout_sampler.py \
        tests/test_rollout_fused_decode.py --tb=short -k "one_row or topk or composed or single_sequence" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    timeout 150 python3 benchmarks/b1_tiles.py --rounds 0 --pairs 3 --ab "lm_head=(8, 8)" --ab "paged_block_n=32" \
        2>&1 | grep -v -i warn
    for round in 1 2; do
        b1 "defaults" X=1
        echo "== session 24's choices (merge 4 warps, top-k reads after the counts)"
        MOELOOP_TOPK_READS_EARLY=off timeout 100 python3 -c "import runpy, sys; from moeloop.rollout import decode_kernel
decode_kernel.MERGE_WARPS = 4
sys.argv = ['rollout.py', '--device', 'cuda', '--size', 'reference', '--batch', '1', '--repeats', '5', '--skip-hf',
            '--step-times']
runpy.run_path('benchmarks/rollout.py', run_name='__main__')" 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
    done
    for batch in 32 256; do
        timeout 120 python3 benchmarks/rollout.py --device cuda --size reference --batch $batch --repeats 3 --skip-hf \
            --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| $batch |walls"
    done
    ;;
oproj)
    MOELOOP_O_PROJ_TILE=8,4 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        --tb=short -k "composed or o_proj_router" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    timeout 150 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 3 --knobs o_proj,row_linear 2>&1 | grep -v -i warn \
        | tee /tmp/tiles.txt
    best=$(sed -n "s/^sweep's best .*'o_proj': (\([0-9]*\), \([0-9]*\)).*/\1,\2/p" /tmp/tiles.txt)
    echo "sweep's o_proj tile: ${best:-none}"
    if [ -n "$best" ] && [ "$best" != "4,4" ]; then
        for round in 1 2; do
            b1 "defaults" X=1
            b1 "o_proj tile $best" MOELOOP_O_PROJ_TILE=$best
        done
    fi
    ;;
qkv)
    MOELOOP_ROW_LINEAR_TILE=8,4 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        --tb=short -k "single_sequence or composed or row_linear" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2 3; do
        b1 "defaults" X=1
        b1 "row_linear 8,4" MOELOOP_ROW_LINEAR_TILE=8,4
    done
    ;;
sweep)
    timeout 240 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 3 --knobs row_linear,o_proj,lm_head,gate_up,down 2>&1 \
        | grep -v -i warn
    ;;
*) echo "usage: $0 merge|final|oproj|qkv|sweep" >&2; exit 2 ;;
esac
