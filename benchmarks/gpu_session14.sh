set -u
timeout 120 python3 benchmarks/profile_decode.py --batch 1 --top 0 --timeline 2>&1 | grep -v -i warn | grep -A30 "decode graph"
timeout 400 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,32,256 --repeats 5 --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| |walls"
