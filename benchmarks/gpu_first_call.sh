#!/usr/bin/env bash
# One device call (< 9 min on an H200) that checks the CUDA paths and re-measures the numbers BENCHMARKS.md tracks:
# the CUDA tests of every Triton kernel, the sampler's timings and agreement check, the actor-update profile, the
# decode-step profile, and the rollout benchmark (moeloop only) with its graph capture times and the spread of its
# step times, a PDL A/B at B=1 and a multi-step decode A/B. `benchmarks/gpu_experiments.sh` is the second call (the
# B=1 tiles in place, see its header), the e2e run against TRL the third:
#   python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 --gen-profile
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_model_norm.py tests/test_model_experts.py tests/test_logprobs.py \
    tests/test_rollout_sampler.py tests/test_rollout_cuda.py tests/test_rollout_fused_decode.py tests/test_sync_shared.py \
    tests/test_kernel_switch.py tests/test_rope_kernel.py tests/test_swiglu_kernel.py tests/test_packed_attention.py \
    --tb=short > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -40  # each failure's assertion lines
tail -1 /tmp/gpu_tests.log
# the sampler per step in CUDA graphs and its agreement with the torch path
timeout 150 python3 benchmarks/sampler.py 2>&1 | tail -7
timeout 150 python3 benchmarks/profile_update.py --micro-batch-tokens 40960 --skip-hf --repeats 3 --top 12
timeout 80 python3 benchmarks/profile_decode.py --batch 1,128,256 --top 6
# the decode step's host/device overlap (session 6's pinned uploads): engine.step times against the forward alone
timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 3 --skip-hf \
    --step-times | grep -v -i warn | tail -11
MOELOOP_PDL=off timeout 60 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 2 \
    --skip-hf | tail -1  # A/B: PDL at B=1
timeout 90 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,256 --repeats 2 --skip-hf \
    --decode-steps 1 | tail -2  # A/B: one decode step per launch
