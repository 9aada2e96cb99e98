#!/usr/bin/env bash
# Session 37's device calls. Run from the repository root with the project importable.
#   t211: (nvidia-h200, about 8 minutes) torch 2.11's run of the session's new and changed tests: LoRA under tensor
#         parallelism (torch's split styles subclassed: `parallel.tensor.ColumnSplit` / `RowSplit`), the planner's
#         weights with adapters, a tied head's optimizer state across pipeline layouts, uneven stages in an interleaved
#         pipeline, Ctrl-C with worker processes, the plan under sequence parallelism; gloo CPU ranks spawned on a CUDA
#         machine (one GPU is lent, so no NCCL run)
set -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-}" in
t211)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        -k "lora or planner_counts" 2>&1 | grep -v W1202 | tail -4
    timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py \
        -k "tied or (interleaved_pipeline_matches and 5) or refuses" 2>&1 | grep -v W1202 | tail -4
    timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_interrupt.py tests/test_plan.py \
        tests/test_layout.py 2>&1 | tail -3
    ;;
rest)  # (what t211 left: its first two pytest calls ran past their timeouts, 13 s a spawned test on that machine)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        -k "lora and (loop or resumes or pipeline)" 2>&1 | grep -v W1202 | tail -4
    timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py \
        -k "tied and (moves or resumes)" 2>&1 | grep -v W1202 | tail -4
    timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_interrupt.py 2>&1 | tail -3
    ;;
*)
    echo "usage: $0 t211|rest" >&2; exit 2
    ;;
esac
