#!/usr/bin/env bash
# The second device call (~5 min on an H200): session 9's early PDL trigger (MOELOOP_PDL_EARLY, on by default) after
# its CUDA tests, as an A/B on "forward graph alone" (profile_decode.py), then the B=1 kernels' warps with it (an
# early trigger lets the next kernel's programs become resident only where registers are left), then the rollout
# benchmark at every batch size.
# Earlier versions: session 8's L2 prefetch, session 9's gate_up and K/V preloads (all removed; BENCHMARKS.md).
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_rollout_paged_attention.py \
    tests/test_rollout_cuda.py tests/test_rollout_multistep.py --tb=short 2>&1 \
    | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20
for early in on off; do
    echo "MOELOOP_PDL_EARLY=$early"
    MOELOOP_PDL_EARLY=$early timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 2>&1 | grep "forward graph"
done
for warps in 4,8,4 8,4,4 4,4,4; do
    echo "warps (row_linear, gate_up, down) = $warps"
    timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 0 --warps $warps 2>&1 | grep "forward graph"
done
timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 2 --skip-hf \
    2>&1 | grep -v -i warn | tail -5
