#!/usr/bin/env bash
# Stop 59's device call (most telling first, each result into $OUT as it finishes): the decode
# attention tests of the branch (stop 57's forms, stop 58's pairs, the shared unit stream) with the
# single warp's kernel (cuda_tests) and the pairs' (cuda_tests_paired5); the A/B of main
# (kvslim_base), the branch (kvslim), the forms patch alone (kvslim_forms) and the pairs
# (kvslim_paired4/4s3/5); the branch's whole suite and memcheck; the pairs' suite and racecheck;
# the branch's racecheck.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/*.xz; do xz -dkf "$f"; done
chmod +x devbin/kvslim* devbin/cuda_tests*
ATT='CudaAttend.*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*'
{ date; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "=== cuda_tests (branch, single warp): the decode attention tests"
  timeout 60 devbin/cuda_tests --gtest_filter="$ATT" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 6000
  echo "attention tests exit: ${PIPESTATUS[0]}"; date; } > "$OUT"/tests.txt 2>&1
{ echo "=== cuda_tests_paired5: the decode attention tests"
  timeout 60 devbin/cuda_tests_paired5 --gtest_filter="$ATT" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 8000
  echo "paired5 attention tests exit: ${PIPESTATUS[0]}"; date; } > "$OUT"/tests_paired.txt 2>&1
grep -q "paired5 attention tests exit: 0" "$OUT"/tests_paired.txt || rm -f devbin/kvslim_paired*
CACHES="kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache" timeout 300 bash bench/cuda/device_kernel_ab.sh > /dev/null 2>&1
{ echo "=== cuda_tests (branch, single warp): every CUDA test"
  timeout 120 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 20000
  echo "tests exit: ${PIPESTATUS[0]}"; date
  echo "=== compute-sanitizer memcheck"
  timeout 110 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:CudaEviction.Zipcache*:CudaEviction.KiviCodes*:CudaCache.*:-CudaStepGraph.*LargerStores' 2>&1 | tail -n 20
  echo "memcheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests.txt 2>&1
if [ -x devbin/kvslim_paired5 ]; then
  { echo "=== cuda_tests_paired5: every CUDA test"
    timeout 120 devbin/cuda_tests_paired5 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 12000
    echo "paired5 tests exit: ${PIPESTATUS[0]}"; date
    echo "=== compute-sanitizer racecheck (cuda_tests_paired5)"
    timeout 120 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 devbin/cuda_tests_paired5 \
      --gtest_filter='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*' 2>&1 \
      | grep -v "^\[       OK\|^\[ RUN" | tail -n 20
    echo "paired5 racecheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests_paired.txt 2>&1
fi
{ echo "=== compute-sanitizer racecheck (the branch's single warp)"
  timeout 120 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -n 20
  echo "racecheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests.txt 2>&1
grep -E "exit|PASSED|FAILED|ERROR SUMMARY" "$OUT"/tests.txt "$OUT"/tests_paired.txt
cat "$OUT"/ab_compare.txt
