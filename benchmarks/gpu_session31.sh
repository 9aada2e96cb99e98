#!/usr/bin/env bash
# Session 31's device calls. Run from the repository root with the project importable.
#   sampling: (nvidia-h200, about 5 minutes) repetition_penalty and min_p in multi-step decode graphs: the CUDA tests
#             of the penalties and the rollout's, then what the options cost the engine at B=1 and B=256 (session 30,
#             one decode step a launch: 2,932 -> 898 tok/s at B=1 with repetition_penalty 1.1)
#   ep:       (nvidia-h200-x2) expert parallelism (parallel.ep=2) over NCCL against one process (not lent in s31)
#   masters:  (nvidia-h200) fp32 master weights: their cost on the goal's job, and CUDA tests
#   final:    (nvidia-h200) the goal's e2e job against TRL at the session's code
#   onelaunch: (nvidia-h200) the penalties' draw as one kernel launch
set -u
source "$(dirname "$0")/gpu_lib.sh"  # sampling_options
case "${1:-}" in
sampling)
    python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py tests/test_rollout_penalties.py 2>&1 | tail -3
    sampling_options "" "--repetition-penalty 1.1" "--min-p 0.05" "--repetition-penalty 1.1 --min-p 0.05"
    ;;
ep)
    # (nvidia-h200-x2, about 5 minutes) expert parallelism over NCCL through torchrun: 2 GPUs x ep 2 against one
    # process (and DP 2 for comparison), and the 2-rank checkpoint resumed in one process
    python3 -m pytest -q -s -p no:cacheprovider tests/test_dp_torchrun.py -k cuda 2>&1 | grep -v -i warn | tail -12
    ;;
masters)
    # (nvidia-h200, about 6 minutes) what fp32 master weights cost the goal's job (moeloop alone, 6 steps each: pure
    # bf16, TRL's setting, then fp32 masters), and the CUDA tests of the code this session touched
    for masters in false true; do
        echo "== model.fp32_master_weights=$masters"
        timeout 200 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 \
            --frameworks moeloop --moeloop-set model.fp32_master_weights=$masters 2>&1 | grep -v -i warn | tail -4
    done
    python3 -m pytest -q -p no:cacheprovider tests/test_master_weights.py tests/test_lora_experts.py tests/test_lora.py \
        tests/test_rollout_cuda.py -k "cuda or master" 2>&1 | tail -3
    ;;
final)
    # (nvidia-h200, about 7 minutes) the goal's e2e job against TRL once at the session's code (pure bf16 on both
    # sides), then the CUDA tests of what changed since the masters call
    timeout 360 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 2>&1 \
        | grep -v -i warn | tail -14
    python3 -m pytest -q -p no:cacheprovider tests/test_master_weights.py tests/test_rollout_penalties.py \
        tests/test_lora_experts.py 2>&1 | tail -2
    ;;
onelaunch)
    # (nvidia-h200, about 4 minutes) the penalties' draw as one gumbel_sample launch: the CUDA penalties test, then
    # decode with repetition_penalty and with min_p (the `sampling` call's figures are the torch-noise draw's)
    python3 -m pytest -q -p no:cacheprovider tests/test_rollout_cuda.py -k penalties 2>&1 | tail -2
    sampling_options "--repetition-penalty 1.1" "--min-p 0.05"
    ;;
*)
    echo "usage: $0 sampling|ep|masters|final|onelaunch" >&2; exit 2
    ;;
esac
