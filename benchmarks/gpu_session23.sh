#!/usr/bin/env bash
# Session 23's device calls. Run from the repository root with the project importable.
#   rope:  (nvidia-h200; needs commit c5f16a4: `qkv_rope` was removed after this run) the q/k norm and RoPE moved
#          into the q|k|v launch and the paged decode (MOELOOP_ROPE_QKV=on): the fused-decode CUDA tests with it on,
#          B=1 decode A/B against the defaults (`rollout.py`, 5 repeats, alternating, twice; the paged decode at 4
#          and 8 warps), the B=1 logprob mismatch off and on, one layer's timeline with it on.
#   final: (nvidia-h200) the CUDA engine tests at the final code, then B=1 three times and B=32, 256 once.
#   preload: (nvidia-h200) MOELOOP_QK_PRELOAD=on: the CUDA engine tests with it, B=1 A/B (3 rounds, alternating).
set -u
source "$(dirname "$0")/gpu_lib.sh"  # b1
case "${1:-}" in
rope)
    MOELOOP_ROPE_QKV=on timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        --tb=short -k "rope_qkv or single_sequence or pdl or bf16 or composed" 2>&1 | tail -4
    for round in 1 2; do
        b1 "defaults" X=1
        b1 "rope_qkv on, paged 4 warps" MOELOOP_ROPE_QKV=on
        b1 "rope_qkv on, paged 8 warps" MOELOOP_ROPE_QKV=on MOELOOP_ROPE_QKV_WARPS=8
    done
    for mode in off on; do
        echo "== logprob mismatch, B=1, MOELOOP_ROPE_QKV=$mode"
        MOELOOP_ROPE_QKV=$mode timeout 120 python3 benchmarks/logprob_mismatch.py --device cuda --size reference \
            --prompts 1 --n 1 2>&1 | grep -v -i warn | tail -2
    done
    MOELOOP_ROPE_QKV=on timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
        | grep -v -i warn | grep -A10 "one layer"
    ;;
final)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py tests/test_rollout_fused_decode.py \
        tests/test_rollout_sampler.py --tb=short 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -8
    for round in 1 2 3; do b1 "defaults, round $round" X=1; done
    timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 32,256 --repeats 2 --skip-hf \
        2>&1 | grep -v -i warn | grep -E "^\| (32|256) "
    ;;
preload)  # the q/k norm launch reading the position, slot and cos/sin row before its wait (MOELOOP_QK_PRELOAD)
    MOELOOP_QK_PRELOAD=on timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py \
        tests/test_rollout_cuda.py --tb=short 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
    for round in 1 2 3; do
        b1 "defaults" X=1
        b1 "qk preload on" MOELOOP_QK_PRELOAD=on
    done
    ;;
*) echo "usage: $0 rope|final|preload" >&2; exit 2 ;;
esac
