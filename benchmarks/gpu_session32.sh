#!/usr/bin/env bash
# Session 32's device calls. Run from the repository root with the project importable.
#   update: (nvidia-h200, about 4 minutes) the actor update of the goal's batch with fp32 masters on and off: time,
#           kernels, host syncs by source line and the GPU's idle gaps (session 31 measured masters at +68 ms in the
#           e2e job, before two mends)
#   final:  (nvidia-h200, about 6 minutes) the goal's e2e job against TRL, 3 repeats, with moeloop training on every
#           sample as TRL does (actor.skip_zero_advantage=false; pure bf16 on both sides)
#   skip:   (nvidia-h200, about 3 minutes) moeloop alone on the goal's job at its defaults (the update skips the
#           zero-advantage samples: all of them on this random-init job); the CUDA tests of the code this session
#           touched
#   zeroadv: (nvidia-h200, about 3 minutes) the update with nothing to train (every advantage 0), masters off and
#           on, then moeloop alone on the goal's job at its defaults
set -u
case "${1:-}" in
update)
    python3 benchmarks/profile_update.py --micro-batch-tokens 40960 --masters off,on --skip-hf --top 0 --host 15 \
        --repeats 3 2>&1 | grep -v -i warn
    ;;
final)
    timeout 560 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 3 \
        --moeloop-set actor.skip_zero_advantage=false 2>&1 | grep -v -i warn | tail -22
    ;;
skip)
    timeout 200 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
        --frameworks moeloop 2>&1 | grep -v -i warn | tail -6
    python3 -m pytest -q -p no:cacheprovider tests/test_master_weights.py tests/test_lora_experts.py \
        tests/test_model_experts.py tests/test_skip_zero_advantage.py 2>&1 | tail -2
    ;;
zeroadv)
    python3 benchmarks/profile_update.py --micro-batch-tokens 40960 --masters off,on --skip-hf --top 3 --host 3 \
        --repeats 3 --zero-adv 2>&1 | grep -v -i warn
    timeout 150 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
        --frameworks moeloop 2>&1 | grep -v -i warn | tail -4
    ;;
*)
    echo "usage: $0 update|final|skip|zeroadv" >&2; exit 2
    ;;
esac
