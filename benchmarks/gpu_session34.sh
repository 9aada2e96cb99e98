#!/usr/bin/env bash
# Session 34's device call. Run from the repository root with the project importable.
#   tests:   (nvidia-h200, about 8 minutes) torch 2.11's run of the tests of the code this session touched: tensor
#            parallelism's DTensor plans, 2-D FSDP meshes, the MoE token split over tp and the gradient norm (gloo CPU
#            ranks, spawned on a CUDA machine: one GPU is lent, so no NCCL run), the parallel groups under context and
#            expert parallelism, the planner
set -u
case "${1:-}" in
tests)
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    timeout 570 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        tests/test_context_parallel.py tests/test_expert_parallel.py tests/test_plan.py tests/test_layout.py 2>&1 \
        | grep -v W1202 | tail -4
    ;;
*)
    echo "usage: $0 tests" >&2; exit 2
    ;;
esac
