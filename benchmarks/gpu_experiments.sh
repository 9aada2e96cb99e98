#!/usr/bin/env bash
# The second device call (~7 min; on a 2-GPU machine for the DP test): DP=2 over NCCL through torchrun against one
# GPU (tests/test_dp_cuda.py), the decode tests with the B=1 norm fold on (the default since session 8), the fold's
# A/B in "forward graph alone", and a decode-steps 8 vs 16 A/B at B=1 and 32.
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -s -p no:cacheprovider tests/test_dp_cuda.py --tb=short 2>&1 | grep -v -i warn | tail -12
python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fused_decode.py tests/test_rollout_cuda.py \
    tests/test_rollout_multistep.py --tb=short 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
for flags in "" "--no-norm-fold"; do
    echo "profile_decode $flags"; timeout 60 python3 benchmarks/profile_decode.py --batch 1 --top 3 $flags | grep "^B=1"
done
for k in 8 16; do
    echo "decode-steps $k"; timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32 \
        --repeats 2 --skip-hf --decode-steps $k | tail -2
done
