#!/usr/bin/env bash
# A decode-kernel variant's call on the GPU machine (devbin/ carried with build_devbin.sh's binaries
# and build_variant.sh's devbin/kvslim_NAME.xz + cuda_tests_NAME.xz): the variant's attention tests
# first (a wrong kernel's timings mean nothing), then the A/B of every devbin/kvslim_*.xz against
# devbin/kvslim (device_kernel_ab.sh), then the variant's whole CUDA suite and racecheck over its
# decode tests. Everything lands in $OUT as it finishes.
#   VARIANT=NAME [CACHES="kivi2_g128 ..."] bash bench/cuda/device_variant_check.sh
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
V=${VARIANT:?name the variant: VARIANT=NAME}
T=devbin/cuda_tests_$V
xz -dkf "$T".xz && chmod +x "$T"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "=== $T: the decode attention tests"
  timeout 90 "$T" --gtest_filter='CudaAttend.*:CudaZipcache.Attention*' 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 6000
  echo "attention tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_$V.txt 2>&1
CACHES=${CACHES:-kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache} timeout ${AB_TIMEOUT:-300} bash bench/cuda/device_kernel_ab.sh > /dev/null 2>&1
{ echo "=== $T: every CUDA test"
  timeout 150 "$T" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 12000
  echo "tests exit: ${PIPESTATUS[0]}"
  echo "=== compute-sanitizer racecheck ($T)"
  timeout 150 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 "$T" \
    --gtest_filter='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -n 20
  echo "racecheck exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests_$V.txt 2>&1
grep -E "exit|PASSED|FAILED|ERROR SUMMARY" "$OUT"/tests_$V.txt
cat "$OUT"/ab_compare.txt
