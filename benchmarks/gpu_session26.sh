#!/usr/bin/env bash
# Session 26's device calls. Run from the repository root with the project importable.
#   first: (nvidia-h200, about 8 minutes) the committed defaults' CUDA tests (the o_proj tile (4, 2), which session 25
#          measured only through MOELOOP_O_PROJ_TILE); session 25's prepared `qkv` A/B (q|k|v's ROW_LINEAR_TILE at
#          (8, 4), +1.8 us per forward in `b1_tiles.py`) at 2 rounds; then its prepared `sweep`.
#   oproj: (nvidia-h200, about 5 minutes) with q|k|v at (8, 4) by default: the CUDA tests of the recorded tiles, then
#          B=1 engine.step in alternation (3 rounds) against the o_proj tile (2, 2) (`first`'s sweep: "o_proj=(2, 2)
#          0.3390 ms, +1.5 us per forward").
#   sweep: (nvidia-h200, about 6 minutes) with both tiles default: `b1_tiles.py` over o_proj (now with 1-row and 1-warp
#          tiles), lm_head (2-row tiles), down (8 warps, 8 rows) and the paged decode's knobs, then the A/Bs' best
#          change in the engine (`--engine-ab 2`).
#   final: (nvidia-h200, about 6 minutes) the final code: the fused decode, paged attention and kernel switch tests on
#          CUDA, B=1 twice, B=32 and B=256 once.
set -u
here="$(dirname "$0")"
source "$here/gpu_lib.sh"  # b1
case "${1:-}" in
first)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        tests/test_rollout_paged_attention.py --tb=short -k "o_proj_router or one_row or composed" 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    MOELOOP_ROW_LINEAR_TILE=8,4 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        --tb=short -k "single_sequence or composed or row_linear" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2; do
        b1 "defaults" X=1
        b1 "row_linear 8,4" MOELOOP_ROW_LINEAR_TILE=8,4
    done
    timeout 200 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 3 --knobs row_linear,o_proj,lm_head,gate_up,down 2>&1 \
        | grep -v -i warn
    ;;
oproj)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        tests/test_rollout_paged_attention.py --tb=short -k "single_sequence or o_proj_router or one_row or composed" \
        2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2 3; do
        b1 "defaults" X=1
        b1 "o_proj tile 2,2" MOELOOP_O_PROJ_TILE=2,2
    done
    ;;
sweep)
    timeout 540 python3 benchmarks/b1_tiles.py --rounds 1 --pairs 3 --engine-ab 2 \
        --knobs o_proj,lm_head,down,paged_block_n,paged_warps,merge_warps 2>&1 | grep -v -i warn
    ;;
final)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        tests/test_rollout_paged_attention.py tests/test_kernel_switch.py --tb=short 2>&1 \
        | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2; do
        b1 "final defaults" X=1
    done
    for batch in 32 256; do
        echo "== B=$batch"
        timeout 120 python3 benchmarks/rollout.py --device cuda --size reference --batch $batch --repeats 3 --skip-hf \
            --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| $batch |walls"
    done
    ;;
*) echo "usage: $0 first|oproj|sweep|final" >&2; exit 2 ;;
esac
