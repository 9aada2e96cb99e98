#!/usr/bin/env bash
# Session 20's device calls. Run from the repository root with the project importable.
#   tests:  the async rollout's CUDA and DP=2 tests (re-run after session 19's refactor), then one B=1 decode
#           layer's timeline (`profile_decode.py --timeline`)
#   e2e:    e2e against TRL on the H200, moeloop colocated and async (one version behind) in one run each
#   priority: the async rollout's CUDA stream at high priority (-1) against the default (0)
#   switch: the GIL switch interval while async (5 ms default) against shorter ones
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
priority)  # the async rollout's stream at high priority against the default, moeloop only, in alternation
    for prio in -1 0 -1 0; do
        echo "== MOELOOP_ROLLOUT_PRIORITY=$prio"
        MOELOOP_ROLLOUT_PRIORITY=$prio timeout 140 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda \
            --steps 6 --repeats 1 --frameworks moeloop --rollout-mode async 2>&1 | grep -E "moeloop: (step|old)"
    done
    ;;
switch)  # the interpreter's GIL switch interval while async (default 5 ms), moeloop only, in alternation
    for sw in 0.0002 0.005 0.00005 0.0002 0.005 0.00005; do
        echo "== MOELOOP_SWITCH_INTERVAL=$sw"
        MOELOOP_SWITCH_INTERVAL=$sw timeout 140 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda \
            --steps 6 --repeats 1 --frameworks moeloop --rollout-mode async 2>&1 | grep -E "moeloop: (step|old)"
    done
    ;;
*) echo "usage: $0 tests|e2e|priority|switch" >&2; exit 2 ;;
esac
