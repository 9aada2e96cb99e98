#!/usr/bin/env bash
# One device call (about 6 min on an H200): the lm_head's persisting L2 window (`rollout.l2_residency`,
# MOELOOP_L2_PERSIST=lm_head) against none. First its tests (the CUDA one checks that outputs do not change) and the
# window the device allows, then B=1 decode (`rollout.py`) in alternation (ROUNDS rounds, default 2), then
# B=32 and 256 with the window, then the B=1 decode graph's timeline with it.
# Run from the repository root with the project importable; logs under $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_l2_residency.py --tb=short > "$out/l2_tests.log" 2>&1
grep -E "^(FAILED|ERROR|E  )" "$out/l2_tests.log" | head -20
tail -1 "$out/l2_tests.log"
MOELOOP_L2_PERSIST=lm_head timeout 60 python3 - <<'PY'
import torch
from moeloop.rollout import l2_residency
w = l2_residency.L2Window(torch.empty(32000, 1536, dtype=torch.bfloat16, device="cuda"))
p = torch.cuda.get_device_properties(0)
print(f"L2 {p.L2_cache_size / 2**20:.1f} MiB; set-aside {w.set_aside / 2**20:.1f} MiB; window {w.num_bytes / 2**20:.1f} MiB; "
      f"hit ratio {w.hit_ratio:.3f}")
PY
b() {  # label, batches, then env assignments
    local label=$1 batches=$2; shift 2
    echo "== $label"
    env "$@" timeout 150 python3 benchmarks/rollout.py --device cuda --size reference --batch "$batches" --repeats 3 \
        --skip-hf --step-times 2>&1 | grep -v -i warn | grep -E "engine.step|^\| [0-9]+ |copy bandwidth"
}
for round in $(seq "${ROUNDS:-2}"); do
    b "no window" 1 MOELOOP_L2_PERSIST=off
    b "lm_head window" 1 MOELOOP_L2_PERSIST=lm_head
done
b "lm_head window, B=32 and 256" 32,256 MOELOOP_L2_PERSIST=lm_head
echo "== timeline, lm_head window"
MOELOOP_L2_PERSIST=lm_head timeout 90 python3 benchmarks/profile_decode.py --batch 1 --top 12 --timeline 2>&1 \
    | grep -v -i warn | tail -25
