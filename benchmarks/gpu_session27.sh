#!/usr/bin/env bash
# Session 27's device calls. Run from the repository root with the project importable.
#   hf:  (nvidia-h200, about 7 minutes) the issue's decode side by side at the current code: moeloop against
#        transformers `generate` on the reference model, B=1/32/256, in one run (`gpu_decode_vs_hf.sh`; last run in
#        session 17, before the B=1 kernels of sessions 18-26)
#   e2e: (nvidia-h200, about 7 minutes) e2e against TRL on the H200, two repeats (session 26 had time for one)
set -u
here="$(dirname "$0")"
case "${1:-}" in
hf)
    bash "$here/gpu_decode_vs_hf.sh"
    ;;
e2e)
    timeout 560 python3 benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 6 --repeats 2 2>&1 \
        | grep -v -i warn | tail -24
    ;;
*) echo "usage: $0 hf|e2e" >&2; exit 2 ;;
esac
