#!/usr/bin/env bash
# Session 30's device calls. Run from the repository root with the project importable.
#   turns:    (nvidia-h200, about 4 minutes) multi-turn tool calling: its CUDA test, what tool turns cost the engine
#             against one turn of the same sampled tokens (with and without the prefix cache), and R3's B=1 decode
#             cost (recording passes over the composed B=1 router; session 29 left it unmeasured)
#   sampling: (nvidia-h200) repetition_penalty and min_p: their CUDA tests and what they cost the engine
set -u
source "$(dirname "$0")/gpu_lib.sh"  # sampling_options
case "${1:-}" in
turns)
    python3 -m pytest -q -p no:cacheprovider tests/test_multi_turn.py tests/test_router_replay.py -k "cuda" 2>&1 | tail -3
    for turns in "4 64" "8 32"; do
        set -- $turns
        timeout 150 python3 benchmarks/tool_turns.py --device cuda --size reference --batch 128 --turns "$1" \
            --turn-tokens "$2" --repeats 2 2>&1 | grep -v -i warn
    done
    for flag in "" --record-routes; do
        timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --skip-hf --repeats 2 \
            $flag 2>&1 | grep -v -i warn | tail -3
    done
    ;;
sampling)
    # (nvidia-h200, about 6 minutes) the CUDA tests of repetition_penalty / min_p, of multi-turn and the rollout's;
    # tool turns again after cached prefill chunks run as one SDPA (the first call: 3x slower with the prefix cache);
    # what the penalties cost the engine (one decode step a launch, torch sampling over the full vocab)
    python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py tests/test_multi_turn.py \
        tests/test_rollout_penalties.py tests/test_rollout_paged_attention.py 2>&1 | tail -3
    timeout 120 python3 benchmarks/tool_turns.py --device cuda --size reference --batch 128 --turns 4 \
        --turn-tokens 64 --repeats 2 2>&1 | grep -v -i warn
    sampling_options "" "--repetition-penalty 1.1" "--min-p 0.05" "--repetition-penalty 1.1 --min-p 0.05"
    ;;
final)
    # (nvidia-h200, about 8 minutes) LoRA's CUDA tests (their first GPU run), the multi-turn and penalties CUDA tests
    # at the merged code, and the goal's e2e job against TRL once at the session's code
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_multi_turn.py tests/test_rollout_penalties.py \
        tests/test_rollout_cuda.py -k "cuda" 2>&1 | tail -3
    timeout 330 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 2>&1 \
        | grep -v -i warn | tail -8
    ;;
*)
    echo "usage: $0 turns|sampling|final" >&2; exit 2
    ;;
esac
