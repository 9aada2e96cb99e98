#!/usr/bin/env bash
# Session 20's device calls. Run from the repository root with the project importable.
#   tests:  the async rollout's CUDA and DP=2 tests (re-run after session 19's refactor), then one B=1 decode
#           layer's timeline (`profile_decode.py --timeline`)
#   e2e:    e2e against TRL on the H200, moeloop colocated and async (one version behind) in one run each
#   apart:  (nvidia-h200-x2) rollout.mode=disaggregated, the engine process on the second GPU: its CUDA test and e2e
#   push:   (nvidia-h200-x2) the disaggregated push with verification off, and with 1 GiB buckets; then on-policy
#           (max_staleness 0: is update_actor's 0.32 s against colocated's 0.22 s the rollout thread's work beside it?)
# (Its `priority` and `switch` sections, A/Bs of the async rollout's stream priority and of the GIL switch interval,
# ran at e3bf73c and cf7070c and were removed with their knobs: neither moved the step. BENCHMARKS.md, session 20.)
set -u
case "${1:-}" in
tests)
    timeout 240 python3 -m pytest -q -x tests/test_rl_async.py -k "cuda or dp2" 2>&1 | tail -4
    timeout 150 python3 benchmarks/profile_decode.py --batch 1 --timeline 2>&1 | grep -v -i warn | tail -45
    ;;
e2e)
    timeout 330 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 \
        --rollout-mode async 2>&1 | grep -v -i warn | tail -14
    timeout 200 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 \
        --frameworks moeloop 2>&1 | grep -v -i warn | tail -8
    ;;
apart)  # two GPUs: the disaggregated engine's CUDA test, then e2e against TRL with the engine on the second GPU
    timeout 200 python3 -m pytest -q -x tests/test_rl_disaggregated.py -k cuda 2>&1 | tail -3
    timeout 380 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 \
        --rollout-mode disaggregated --rollout-device cuda:1 2>&1 | grep -v -i warn | tail -14
    ;;
push)  # two GPUs: what the disaggregated push's 97 ms is made of; moeloop alone, one repeat each
    for extra in "" "--moeloop-set=sync.verify=false" "--moeloop-set=sync.bucket_bytes=1073741824" \
                 "--moeloop-set=rollout.max_staleness=0"; do
        echo "== ${extra:-defaults (64 MiB buckets, verified)}"
        timeout 100 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
            --frameworks moeloop --rollout-mode disaggregated --rollout-device cuda:1 $extra 2>&1 \
            | grep -E "moeloop: (step|old)"
    done
    ;;
*) echo "usage: $0 tests|e2e|apart|push" >&2; exit 2 ;;
esac
