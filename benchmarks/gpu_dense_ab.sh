#!/usr/bin/env bash
# Session 16's dense-projection A/B (~6 min on an H200): cuBLAS vs `_dense_gemm` alone (tile sweep), then the
# decode forward graph at B=32/128/256 with q|k|v and o_proj through each, PDL at <= 8 rows (the default) or all.
# Run from the repository root with the project importable.
set -u
timeout 240 python3 benchmarks/dense_decode_gemm.py --tokens 32,128,256 --sweep 2>&1 | grep -v -i warn
for combo in "cublas 8" "triton 8" "cublas 256" "triton 256" "cublas 8" "triton 256"; do
  set -- $combo
  echo "MOELOOP_DENSE_GEMM=$1 MOELOOP_PDL_MAX_ROWS=$2"
  MOELOOP_DENSE_GEMM=$1 MOELOOP_PDL_MAX_ROWS=$2 timeout 120 python3 benchmarks/profile_decode.py \
      --batch 32,128,256 --top 0 --steps 10 2>&1 | grep -E "forward graph|Error|error" | grep -v -i warn
done
