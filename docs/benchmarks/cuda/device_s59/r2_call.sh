#!/usr/bin/env bash
# Stop 59's second device call (most telling first, each result into $OUT as it finishes): the decode
# attention tests of the branch (the pairs for 4-bit keys at head_dim 128, the single warp elsewhere:
# cuda_tests) and of the pairs everywhere (cuda_tests_paired); racecheck of both over the attention
# tests, whole reports kept; the A/B of main (kvslim_base), the branch (kvslim), the single warp
# everywhere (kvslim_single) and the pairs everywhere (kvslim_paired); the branch's whole suite and
# memcheck; racecheck over the eviction-over-codes tests.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/*.xz; do xz -dkf "$f"; done
chmod +x devbin/kvslim* devbin/cuda_tests*
ATT='CudaAttend.*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*'
RACE='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*'
{ date; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  for bin in cuda_tests cuda_tests_paired; do
    echo "=== $bin: the decode attention tests"
    timeout 60 devbin/$bin --gtest_filter="$ATT" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 5000
    echo "$bin attention tests exit: ${PIPESTATUS[0]}"; date
  done; } > "$OUT"/tests.txt 2>&1
for bin in cuda_tests_paired cuda_tests; do
  timeout 60 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 --error-exitcode 9 devbin/$bin \
    --gtest_filter="$RACE" > "$OUT"/racecheck_$bin.txt 2>&1
  echo "racecheck exit: $?" >> "$OUT"/racecheck_$bin.txt
done
CACHES="kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache" timeout 230 bash bench/cuda/device_kernel_ab.sh > /dev/null 2>&1
{ echo "=== cuda_tests: every CUDA test"
  timeout 120 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 12000
  echo "tests exit: ${PIPESTATUS[0]}"; date
  echo "=== compute-sanitizer memcheck"
  timeout 110 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:CudaEviction.Zipcache*:CudaEviction.KiviCodes*:CudaCache.*:-CudaStepGraph.*LargerStores' 2>&1 | tail -n 20
  echo "memcheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests.txt 2>&1
for bin in cuda_tests_paired cuda_tests; do
  timeout 75 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 --error-exitcode 9 devbin/$bin \
    --gtest_filter='CudaEviction.KiviCodesUnderH2o*' > "$OUT"/racecheck_eviction_$bin.txt 2>&1
  echo "racecheck exit: $?" >> "$OUT"/racecheck_eviction_$bin.txt
done
grep -E "exit|PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/*.txt
cat "$OUT"/ab_compare.txt
