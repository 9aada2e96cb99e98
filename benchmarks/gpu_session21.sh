#!/usr/bin/env bash
# Session 21's device call. Run from the repository root with the project importable, on nvidia-h200-x2.
#   threads: rollout.mode=disaggregated generating ahead (engine on cuda:1), moeloop alone: is update_actor's 0.33 s
#            (0.22 s on-policy and colocated, session 21 item 2) host threads oversubscribed while the engine process
#            runs beside the update? Defaults, then the engine process at one torch thread, then both sides at 4.
#            Then e2e against TRL with the engine on cuda:1 at the defaults (after session 20's fingerprint rewrite).
set -u
case "${1:-}" in
threads)
    for extra in "" "--moeloop-set=rollout.threads=1" "--threads 4 --moeloop-set=rollout.threads=4"; do
        echo "== ahead ${extra:-defaults}"
        timeout 100 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
            --frameworks moeloop --rollout-mode disaggregated --rollout-device cuda:1 $extra 2>&1 | grep -E "moeloop: "
    done
    timeout 330 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 \
        --rollout-mode disaggregated --rollout-device cuda:1 2>&1 | grep -v -i warn | tail -14
    ;;
*) echo "usage: $0 threads" >&2; exit 2 ;;
esac
