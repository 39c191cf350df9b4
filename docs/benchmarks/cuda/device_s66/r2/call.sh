#!/usr/bin/env bash
# Stop 66's second call: pending_s66's form under compute-sanitizer, then its bench against SDPA.
set -u
source bench/cuda/device_prelude.sh >/dev/null 2>&1
keep_report() { grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard|PASSED|FAILED" | head -40; }
SAN='CudaAttend.*:CudaKivi.*:CudaZipcache.*:CudaStepGraph.*:-CudaStepGraph.*LargerStores'
{ timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests_land --gtest_filter="$SAN" 2>&1 | keep_report
  echo "memcheck exit: ${PIPESTATUS[0]}"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 devbin/cuda_tests_land \
    --gtest_filter='CudaKivi.*:CudaZipcache.Probabilities*' 2>&1 | keep_report
  echo "racecheck exit: ${PIPESTATUS[0]}"; } > "$OUT"/sanitizer.txt
cat "$OUT"/sanitizer.txt
timeout 90 devbin/kvslim_land bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --json "$OUT"/attend_cuda.json > "$OUT"/attend_cuda.txt 2>&1
timeout 120 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend_cuda.json --json "$OUT"/sdpa.json > "$OUT"/compare.txt 2>&1
cat "$OUT"/compare.txt | tail -40
