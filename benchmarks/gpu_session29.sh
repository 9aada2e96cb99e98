#!/usr/bin/env bash
# Session 29's device calls. Run from the repository root with the project importable.
#   tests: (nvidia-h200, about 9 minutes) the test files that session 28 changed, whole, with their CUDA cases (the
#          reward model's bf16 case had never run on a GPU), and the CUDA rollout tests
#   e2e:   (nvidia-h200, about 5 minutes) e2e against TRL on the H200, the goal's job, one repeat at this code
#   replay: router replay's CUDA test and measurements (below)
#   e2e_replay: what R3 costs a whole RL step (below; its "off" run failed on the YAML bool, fixed since)
#   final: the same after the fused decode forward learnt to record (below)
#   last: R3's cost in an RL step at the session's final code (below)
set -u
here="$(dirname "$0")"

r3_step_cost() {  # STEPS TIMEOUT_S: the goal's e2e job, moeloop alone, actor.router_replay off then R3
    for set in actor.router_replay=off actor.router_replay=R3; do
        echo "== $set"
        timeout "$2" python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps "$1" --repeats 1 \
            --frameworks moeloop --moeloop-set $set 2>&1 | grep -v -i warn | grep -E "median over|moeloop:|gen |rror"
    done
}
case "${1:-}" in
tests)
    FILES="tests/test_reward_model.py tests/test_rl_loop.py tests/test_sft.py tests/test_rollout_cuda.py \
tests/test_rl_async.py tests/test_rl_disaggregated.py" bash "$here/gpu_suite.sh" 560
    ;;
e2e)
    timeout 560 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 2>&1 \
        | grep -v -i warn | tail -24
    ;;
replay)
    # (nvidia-h200, about 7 minutes) router replay on the GPU: its CUDA test, the CUDA cases of the two files the
    # first call's time limit cut, the logprob mismatch with and without R3, and the decode cost of recording
    python3 -m pytest -q -p no:cacheprovider tests/test_router_replay.py tests/test_rl_loop.py \
        tests/test_rl_disaggregated.py -k "cuda" 2>&1 | tail -4
    timeout 200 python3 benchmarks/router_replay.py --device cuda --size reference --batch 32 --repeats 2 2>&1 \
        | grep -v -i warn
    for flag in "" --record-routes; do
        timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 32,256 --skip-hf --repeats 2 \
            $flag 2>&1 | grep -v -i warn | tail -4
    done
    ;;
e2e_replay)
    # (nvidia-h200, about 4 minutes) what R3 costs a whole RL step: the goal's job, moeloop alone, without and with
    # actor.router_replay=R3 (the recording engine, the update replaying the rollout's routes)
    r3_step_cost 6 270
    ;;
final)
    # (nvidia-h200, about 5 minutes) after the fused decode forward learnt to record: the CUDA test, the mismatch
    # and the recording engine's rate, and R3's cost in a whole RL step (off, then R3)
    python3 -m pytest -q -p no:cacheprovider tests/test_router_replay.py -k "cuda" 2>&1 | tail -2
    timeout 150 python3 benchmarks/router_replay.py --device cuda --size reference --batch 32 --repeats 2 2>&1 \
        | grep -v -i warn
    r3_step_cost 6 120
    ;;
last)
    # (nvidia-h200, about 3 minutes) the session's final code: R3's cost in an RL step with the routes sent as int16
    r3_step_cost 5 100
    ;;
*) echo "usage: $0 tests|e2e|replay|e2e_replay|final|last" >&2; exit 2 ;;
esac
