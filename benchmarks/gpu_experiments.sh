#!/usr/bin/env bash
# A device call on a 2-GPU machine (~5 min): DP=2 over NCCL through torchrun against one GPU, and a 2-rank
# checkpoint resumed on one (tests/test_dp_cuda.py), then a decode-steps 8 vs 16 A/B at B=1.
# Run from the repository root with the project importable.
set -u
python3 -m pytest -q -s -p no:cacheprovider tests/test_dp_cuda.py --tb=short 2>&1 | grep -v -i warn | tail -12
for k in 8 16; do
    echo "decode-steps $k"; timeout 80 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 \
        --repeats 2 --skip-hf --decode-steps $k | tail -1
done
