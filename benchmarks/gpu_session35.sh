#!/usr/bin/env bash
# Session 35's device calls. Run from the repository root with the project importable.
#   pp:   (nvidia-h200, about 8 minutes) torch 2.11's run of the pipeline-parallel tests: send/recv inside autograd,
#         the stage meshes (a 3-D DeviceMesh sliced per stage), the head outputs' broadcast, DCP across pipeline
#         layouts (gloo CPU ranks, spawned on a CUDA machine: one GPU is lent, so no NCCL run)
#   tp:   the tensor-parallel tests session 34 could not run under torch 2.11 (the head's split, the loop cases)
#   final: (about 7 minutes) the pipeline- and tensor-parallel trainer tests at the final code (1F1B, forward-only
#         overlap, R2, tied embeddings; not the loop ones)
#   e2e:  moeloop's side of the goal's e2e job (the update now runs through `pipeline.run_passes`, one process: a
#         regression check; TRL not run)
set -u
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-}" in
pp)
    timeout 570 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py 2>&1 \
        | grep -v W1202 | tail -6
    ;;
tp)
    timeout 570 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_tensor_parallel.py \
        -k "matches_one_process or resumes" 2>&1 | grep -v W1202 | tail -6
    ;;
final)
    timeout 570 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_pipeline_parallel.py \
        tests/test_tensor_parallel.py -k "not loop and not sft_at and not planner" 2>&1 | grep -v W1202 | tail -4
    ;;
e2e)
    timeout 570 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --frameworks moeloop --steps 6 \
        --repeats 1 2>&1 | tail -8
    ;;
*)
    echo "usage: $0 pp|tp|final|e2e" >&2; exit 2
    ;;
esac
