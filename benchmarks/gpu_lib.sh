# Shared by the gpu_*.sh device scripts (sourced): b1 LABEL [VAR=value ...] runs one B=1 decode measurement
# (`rollout.py`, reference model, 5 repeats, engine.step times) with those environment assignments and prints its
# engine.step, walls and table lines under "== LABEL".
b1() {
    local label=$1; shift
    echo "== $label"
    env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 \
        --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
}
