#!/usr/bin/env bash
# Session 36's device calls. Run from the repository root with the project importable.
#   vpp:  (nvidia-h200, about 4 minutes) torch 2.11's run of the interleaved-pipeline tests (parallel.vpp: the chunk
#         passes, the second pp group for gradients, the schedules, the refusals) and the planner's; gloo CPU ranks,
#         spawned on a CUDA machine (one GPU is lent, so no NCCL run)
#   pp:   (about 7 minutes) the rest of the pipeline tests, whose 1F1B now comes from the same schedule function
#   final: the meshes now built from groups made with the run's timeout (DeviceMesh.from_group) under torch 2.11: the
#         timeout test, tp above the kv heads (tp 4), the expert-parallel and the 4-rank interleaved cases
#   sp:   (about 4 minutes) the sequence-parallel one-process comparisons (merged after `final`)
set -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
VPP="interleaved or whole_groups or every_schedule or megatrons or 1f1b or refuses"
case "${1:-}" in
vpp)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py -k "$VPP" \
        2>&1 | grep -v W1202 | tail -6
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_plan.py tests/test_layout.py 2>&1 | tail -3
    ;;
pp)
    timeout 570 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py \
        -k "not ($VPP)" 2>&1 | grep -v W1202 | tail -6
    ;;
final)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        tests/test_expert_parallel.py tests/test_pipeline_parallel.py \
        -k "timeout or (tensor_parallel_matches and (4-4 or 4-2-1)) or ep_block_equals or (interleaved_pipeline_matches and 4-2-2)" \
        2>&1 | grep -v W1202 | tail -6
    ;;
sp)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        -k "sequence_parallel and not loop" 2>&1 | grep -v W1202 | tail -6
    ;;
*)
    echo "usage: $0 vpp|pp|final|sp" >&2; exit 2
    ;;
esac
