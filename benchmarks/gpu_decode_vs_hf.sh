#!/usr/bin/env bash
# Session 17 (~6 min on an H200): B=1/32/256 decode of the reference model against transformers `generate` (the
# same model, prompts and sampling, in one run; transformers decodes 32 new tokens per batch size, its decode
# tok/s still from decode steps only) and the HBM roofline. Run from the repository root with the project importable.
set -u
timeout 420 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 3 \
    --hf-new-tokens 1:32,32:32,256:32 --step-times 2>&1 | grep -v -i warn | grep -E "^#|^\| |walls|Error"
