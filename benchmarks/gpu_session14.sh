#!/usr/bin/env bash
# Session 14's closing device call (~8 min on an H200): B=1/32/256 decode with the session's sampler changes
# (short bisections on by default, the last program's loads hoisted), then the e2e RL step against TRL.
# Run from the repository root with the project importable.
set -u
timeout 200 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 5 --skip-hf \
    --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| |walls"
timeout 380 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 2>&1 \
    | grep -v -i warn | tail -12
