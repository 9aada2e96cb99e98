#!/usr/bin/env bash
# One device call (< 8 min on an H200) that checks the CUDA paths and re-measures the numbers BENCHMARKS.md tracks:
# the CUDA tests of every Triton kernel, the actor-update profile, the decode-step profile with the A/Bs of the
# kernels not yet measured, and the rollout benchmark (moeloop only). The e2e run against TRL is the second call:
#   python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 1 --gen-profile
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_model_norm.py tests/test_model_experts.py tests/test_logprobs.py \
    tests/test_rollout_sampler.py tests/test_rollout_cuda.py tests/test_rollout_fused_decode.py tests/test_sync_shared.py \
    tests/test_kernel_switch.py tests/test_rope_kernel.py tests/test_swiglu_kernel.py tests/test_packed_attention.py \
    --tb=short > /tmp/gpu_tests.log 2>&1
grep -E "^(FAILED|ERROR|E  )" /tmp/gpu_tests.log | head -40  # each failure's assertion lines
tail -1 /tmp/gpu_tests.log
timeout 150 python3 benchmarks/profile_update.py --micro-batch-tokens 40960 --skip-hf --repeats 3 --top 12
timeout 60 python3 benchmarks/profile_decode.py --batch 128,256 --top 6 --top-k -1
timeout 40 python3 benchmarks/profile_decode.py --batch 128 --top 3 --top-k -1 --no-qkv-pack      # A/B: QKVPack
timeout 40 python3 benchmarks/profile_decode.py --batch 128 --top 3 --top-k -1 --no-router-fused  # A/B: _router_topk
timeout 120 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 1 --skip-hf | tail -5
