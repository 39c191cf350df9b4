#!/usr/bin/env bash
# Stop 60's second call (~200 s, most telling first, each result into $OUT as it finishes): does
# racecheck follow the pairs' hand-over? racecheck_probe's four hand-overs (named barriers, a real
# race, mbarriers, lock step); the decode attention tests and racecheck of the rule build (pairs for
# 4-bit keys in kivi's forms, named barriers: cuda_tests) and of its mbarrier build (cuda_tests_mbar);
# memcheck of the mbarrier build over the graph, eviction and cache tests; the A/B of main
# (kvslim_base), the mbarrier build and the named build.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
source bench/cuda/sanitizer_report.sh  # keep_report
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/*.xz; do xz -dkf "$f"; done
chmod +x devbin/kvslim* devbin/cuda_tests* devbin/racecheck_probe
{ date; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  for m in arrive racy mbarrier sync; do
    echo "=== racecheck_probe $m"
    timeout 30 devbin/racecheck_probe $m; echo "plain exit: $?"
    timeout 60 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 4 --error-exitcode 9 devbin/racecheck_probe $m 2>&1 | keep_report
    echo "racecheck exit: ${PIPESTATUS[0]}"
  done; } > "$OUT"/probe.txt 2>&1
ATT='CudaAttend.*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*'
RACE='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*'
{ for bin in cuda_tests_mbar cuda_tests; do
    echo "=== $bin: the decode attention tests"
    timeout 40 devbin/$bin --gtest_filter="$ATT" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 4000
    echo "$bin attention tests exit: ${PIPESTATUS[0]}"; date
  done; } > "$OUT"/tests.txt 2>&1
for bin in cuda_tests_mbar cuda_tests; do
  timeout 45 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 --error-exitcode 9 devbin/$bin \
    --gtest_filter="$RACE" > "$OUT"/racecheck_$bin.txt 2>&1
  echo "racecheck exit: $?" >> "$OUT"/racecheck_$bin.txt
done
{ echo "=== compute-sanitizer memcheck: cuda_tests_mbar"
  timeout 50 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests_mbar \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:CudaEviction.Zipcache*:CudaEviction.KiviCodes*:CudaCache.*:-CudaStepGraph.*LargerStores' 2>&1 | keep_report
  echo "memcheck exit: ${PIPESTATUS[0]}"; date; } >> "$OUT"/tests.txt 2>&1
CACHES="kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache" timeout 80 bash bench/cuda/device_kernel_ab.sh > /dev/null 2>&1
grep -E "exit|PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY|readers" "$OUT"/*.txt
cat "$OUT"/ab_compare.txt
