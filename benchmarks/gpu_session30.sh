#!/usr/bin/env bash
# Session 30's device calls. Run from the repository root with the project importable.
#   turns:    (nvidia-h200, about 4 minutes) multi-turn tool calling: its CUDA test, what tool turns cost the engine
#             against one turn of the same sampled tokens (with and without the prefix cache), and R3's B=1 decode
#             cost (recording passes over the composed B=1 router; session 29 left it unmeasured)
#   sampling: (nvidia-h200) repetition_penalty and min_p: their CUDA tests and what they cost the engine
set -u
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
*)
    echo "usage: $0 turns|sampling" >&2; exit 2
    ;;
esac
