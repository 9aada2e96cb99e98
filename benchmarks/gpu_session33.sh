#!/usr/bin/env bash
# Session 33's device calls. Run from the repository root with the project importable.
#   final:   (nvidia-h200, about 7 minutes) the goal's e2e job against TRL, 3 repeats, moeloop training on every sample
#            as TRL does (actor.skip_zero_advantage=false; pure bf16 on both sides), after context parallelism moved
#            the trainer's forward and host sums; then moeloop alone with its default fp32 master weights
#   tests:   (nvidia-h200, about 4 minutes) the CUDA runs of the tests of the code this session touched (the context
#            parallel ones run gloo CPU ranks, spawned on a CUDA machine)
set -u
case "${1:-}" in
final)
    timeout 420 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 3 \
        --moeloop-set actor.skip_zero_advantage=false 2>&1 | grep -v -i warn | tail -22
    timeout 150 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
        --frameworks moeloop --moeloop-set actor.skip_zero_advantage=false \
        --moeloop-set model.fp32_master_weights=true 2>&1 | grep -v -i warn | tail -5
    ;;
tests)
    timeout 500 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_trainer.py tests/test_context_parallel.py \
        tests/test_skip_zero_advantage.py tests/test_master_weights.py tests/test_layout.py 2>&1 | tail -3
    ;;
*)
    echo "usage: $0 final|tests" >&2; exit 2
    ;;
esac
