# Shared by the gpu_*.sh device scripts (sourced): b1 LABEL [VAR=value ...] runs one B=1 decode measurement
# (`rollout.py`, reference model, 5 repeats, engine.step times) with those environment assignments and prints its
# engine.step, walls and table lines under "== LABEL"; sampling_options "FLAGS" ... runs B=1 and B=256 decode once per
# set of rollout.py sampling flags (top-k off, e.g. "--repetition-penalty 1.1"; "" = none), printing its table rows.
b1() {
    local label=$1; shift
    echo "== $label"
    env "$@" timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1 --repeats 5 \
        --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| 1 |walls"
}

sampling_options() {
    local flags
    for flags in "$@"; do
        echo "== $flags"
        timeout 100 python3 benchmarks/rollout.py --device cuda --size reference --batch 1,256 --skip-hf \
            --repeats 2 --top-k 0 $flags 2>&1 | grep -v -i warn | grep "^| [0-9]"
    done
}
