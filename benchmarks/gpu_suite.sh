#!/usr/bin/env bash
# The whole test suite on the GPU machine, one file at a time inside a time budget, so that a slow or stuck file
# costs its own limit and the rest still report (a single `pytest tests/` that hits the device call's limit
# returns nothing). Run from the repository root with the project importable (PYTHON: the interpreter, python3):
#     bash benchmarks/gpu_suite.sh [BUDGET_S [FIRST_FILE]]      # e.g. 540 tests/test_rl_loop.py to resume
#     FILES="tests/test_a.py tests/test_b.py" bash benchmarks/gpu_suite.sh 540   # only these files
# Prints one line per file (its pytest summary), the failures' short summary, and the file it stopped before;
# the log ($OUT/gpu_suite.log) has each file's output with its three slowest tests. A file gets at most
# PER_FILE_S seconds (240; the sampler's compiled variants take over 120 s on the H200).
set -u
budget=${1:-540}
first=${2:-}
start=$(date +%s)
log=${OUT:-/tmp}/gpu_suite.log
: > "$log"
per_file=${PER_FILE_S:-240}
for f in ${FILES:-tests/test_*.py}; do
  if [ -n "$first" ] && [[ "$f" < "$first" ]]; then continue; fi
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then echo "budget spent: stopped before $f"; break; fi
  out=$(timeout "$(( left < per_file ? left : per_file ))" "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider \
        --durations=3 "$f" 2>&1)
  rc=$?
  echo "$out" >> "$log"
  echo "$f rc=$rc: $(echo "$out" | grep -E '(passed|failed|error|skipped|deselected)( |,|$)' | tail -1)"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then echo "$out" | grep -E "^(FAILED|ERROR) " | head -10; fi
done
