#!/usr/bin/env bash
# Session 21's device calls. Run from the repository root with the project importable.
#   threads: rollout.mode=disaggregated generating ahead (engine on cuda:1), moeloop alone: is update_actor's 0.33 s
#            (0.22 s on-policy and colocated, session 21 item 2) host threads oversubscribed while the engine process
#            runs beside the update? Defaults, then the engine process at one torch thread, then both sides at 4.
#            Then e2e against TRL with the engine on cuda:1 at the defaults (after session 20's fingerprint rewrite).
#   inplace: (nvidia-h200) for the next session: the CUDA disaggregated test on one GPU (lent buffers read in place)
#   buckets: (nvidia-h200-x2) for the next session: the push at three bucket sizes
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
inplace)  # one GPU: the engine process on the trainer's GPU reads the lent CUDA buffers in place (not yet run)
    timeout 200 python3 -m pytest -q -x tests/test_rl_disaggregated.py -k cuda 2>&1 | tail -3
    ;;
buckets)  # two GPUs: the lent-buffer push at 64 MiB, 256 MiB and 1 GiB buckets (is a larger default worth its memory?)
    for bytes in 67108864 268435456 1073741824; do
        echo "== sync.bucket_bytes=$bytes"
        timeout 100 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
            --frameworks moeloop --rollout-mode disaggregated --rollout-device cuda:1 \
            --moeloop-set=sync.bucket_bytes=$bytes 2>&1 | grep -E "moeloop: "
    done
    ;;
*) echo "usage: $0 threads|inplace|buckets" >&2; exit 2 ;;
esac
