#!/usr/bin/env bash
# One device call (< 10 min on an H200) that checks the CUDA paths and re-measures the numbers BENCHMARKS.md tracks:
# the CUDA tests of every Triton kernel, the actor-update profile, the decode-step profile, the rollout benchmark
# (moeloop only) and one end-to-end run of moeloop. Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_model_norm.py tests/test_model_experts.py tests/test_logprobs.py \
    tests/test_rollout_sampler.py tests/test_rollout_cuda.py tests/test_rollout_fused_decode.py tests/test_sync_shared.py \
    tests/test_kernel_switch.py 2>&1 | tail -5
timeout 150 python3 benchmarks/profile_update.py --micro-batch-tokens 40960 --skip-hf --repeats 3 --top 12
timeout 90 python3 benchmarks/profile_decode.py --batch 1,128,256 --top 8
timeout 40 python3 benchmarks/profile_decode.py --batch 1 --top 8 --no-row-linear  # A/B of the B=1 projections
timeout 120 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 1 --skip-hf | tail -5
timeout 150 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 --frameworks moeloop | tail -9
