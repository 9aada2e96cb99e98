#!/usr/bin/env bash
# Session 22's device calls. Run from the repository root with the project importable.
#   compose: (nvidia-h200) the router composed into the o_proj launch (MOELOOP_ROUTER_COMPOSE=on; `ComposedRouter`):
#            its CUDA tests, B=1 decode A/B against the defaults (`rollout.py`, 5 repeats, alternating, twice), one
#            layer's timeline with it on and off. (Its first version, run once: also session 21's one-GPU
#            disaggregated CUDA test, and the mismatch below.)
#   mismatch: the B=1 engine-vs-trainer logprob mismatch with the composed router off and on.
#   buckets: (nvidia-h200-x2) session 21's push at three bucket sizes (`gpu_session21.sh buckets`).
set -u
case "${1:-}" in
compose)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py --tb=short \
        -k "composed or o_proj_router or single_sequence or pdl or bf16" 2>&1 | tail -4
    b1() {  # label, then env assignments
        local label=$1; shift
        echo "== $label"
        env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 \
            --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
    }
    b1 "defaults" X=1
    b1 "composed router" MOELOOP_ROUTER_COMPOSE=on
    b1 "composed router, 1 router row a program" MOELOOP_ROUTER_COMPOSE=on MOELOOP_ROUTER_COMPOSE_ROWS=1
    b1 "composed router, gate_up norms after its loads" MOELOOP_ROUTER_COMPOSE=on MOELOOP_COMPOSE_NORM_LATE=on
    b1 "defaults" X=1
    b1 "composed router" MOELOOP_ROUTER_COMPOSE=on
    MOELOOP_ROUTER_COMPOSE=on timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
        | grep -v -i warn | grep -A10 "one layer"
    timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 \
        | grep -v -i warn | grep -A10 "one layer"
    ;;
rows)  # third call: the router rows per program of the composed launch, and the mismatch below
    b1() {  # label, then env assignments
        local label=$1; shift
        echo "== $label"
        env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 \
            --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
    }
    for round in 1 2; do
        b1 "defaults" X=1
        for rows in 1 2 4; do
            [ "$round$rows" = 24 ] || b1 "composed router, $rows router rows a program" MOELOOP_ROUTER_COMPOSE=on \
                MOELOOP_ROUTER_COMPOSE_ROWS=$rows
        done
    done
    bash "$0" mismatch
    ;;
mismatch)
    for mode in off on; do
        echo "== logprob mismatch, B=1, MOELOOP_ROUTER_COMPOSE=$mode"
        MOELOOP_ROUTER_COMPOSE=$mode timeout 120 python3 benchmarks/logprob_mismatch.py --device cuda --size reference \
            --prompts 1 --n 1 2>&1 | grep -v -i warn | tail -2
    done
    ;;
final)  # the composed router on by default (1 row a program): the CUDA engine tests, then B=1 on and off
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py tests/test_rollout_fused_decode.py \
        tests/test_rollout_sampler.py --tb=short 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -8
    for mode in on off; do
        echo "== B=1, MOELOOP_ROUTER_COMPOSE=$mode"
        MOELOOP_ROUTER_COMPOSE=$mode timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 \
            --repeats 5 --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
    done
    ;;
buckets) bash benchmarks/gpu_session21.sh buckets ;;
*) echo "usage: $0 compose|rows|mismatch|final|buckets" >&2; exit 2 ;;
esac
