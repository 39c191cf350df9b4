#!/usr/bin/env bash
# pending_s59's device call (written in stop 59, not yet run; ~150-230 s, most telling first, each result into $OUT):
# the decode attention tests of the branch (the pairs for 4-bit keys at head_dim 128, the single warp
# elsewhere: cuda_tests) and of the pairs everywhere (cuda_tests_paired); racecheck of both over two
# attention tests with whole reports; the branch's whole suite and memcheck; the A/B of main
# (kvslim_base), the branch (kvslim), the single warp everywhere and the pairs everywhere.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
source bench/cuda/sanitizer_report.sh  # keep_report
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/*.xz; do xz -dkf "$f"; done
chmod +x devbin/kvslim* devbin/cuda_tests*
ATT='CudaAttend.*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*'
RACE='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*'
{ date; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  for bin in cuda_tests cuda_tests_paired; do
    echo "=== $bin: the decode attention tests"
    timeout 40 devbin/$bin --gtest_filter="$ATT" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 4000
    echo "$bin attention tests exit: ${PIPESTATUS[0]}"; date
  done; } > "$OUT"/tests.txt 2>&1
for bin in cuda_tests_paired cuda_tests; do
  timeout 45 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 --error-exitcode 9 devbin/$bin \
    --gtest_filter="$RACE" > "$OUT"/racecheck_$bin.txt 2>&1
  echo "racecheck exit: $?" >> "$OUT"/racecheck_$bin.txt
done
{ echo "=== cuda_tests: every CUDA test"
  timeout 60 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 10000
  echo "tests exit: ${PIPESTATUS[0]}"; date
  echo "=== compute-sanitizer memcheck"
  timeout 50 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:CudaEviction.Zipcache*:CudaEviction.KiviCodes*:CudaCache.*:-CudaStepGraph.*LargerStores' 2>&1 | keep_report
  echo "memcheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests.txt 2>&1
CACHES="kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache" timeout 60 bash bench/cuda/device_kernel_ab.sh > /dev/null 2>&1
grep -E "exit|PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/*.txt
cat "$OUT"/ab_compare.txt
