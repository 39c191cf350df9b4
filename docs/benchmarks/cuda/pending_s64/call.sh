#!/usr/bin/env bash
# pending_s64 (written in stop 63, not run): the decode codes kernel with its units copied by the TMA
# (KVSLIM_HALF_TMA=1: lane 0's bulk copies completing on a stage's mbarrier, tma_copies.patch).
# Its tests and memcheck / racecheck first, then an A/B against main (and the same at 3 and 4 stages,
# which the bulk copies make cheap in instructions), then main's bench against SDPA.
set -u
source bench/cuda/device_prelude.sh  # OUT, the library path, gpu.txt, devbin unpacked
TESTS='CudaAttend.*:CudaKivi.*:CudaZipcache.*:CudaStepGraph.*:CudaEviction.Kivi*:CudaEviction.Zipcache*:-CudaStepGraph.*LargerStores'
{ timeout 150 devbin/cuda_tests_tma --gtest_filter="$TESTS" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 8000
  echo "tests exit: ${PIPESTATUS[0]}"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests_tma \
    --gtest_filter='CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel:CudaKivi.*:CudaZipcache.Attention*' 2>&1 | tail -c 4000
  echo "memcheck exit: ${PIPESTATUS[0]}"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 devbin/cuda_tests_tma \
    --gtest_filter='CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel' 2>&1 | tail -c 4000
  echo "racecheck exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_tma.txt 2>&1
tail -c 3000 "$OUT"/tests_tma.txt
ARGS="bench attend --device cuda --batch 8 1 --context 32768 --head-dim 128 --cache kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
for name in kvslim kvslim_tma kvslim_tma3 kvslim_tma4 kvslim; do
  { echo "=== $name"; timeout 60 devbin/$name $ARGS 2>&1 | grep -E "^ *128 |rror|what"; } >> "$OUT"/tma_ab.txt
done
cat "$OUT"/tma_ab.txt
timeout 100 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json "$OUT"/attend.json > "$OUT"/attend.txt 2>&1
timeout 100 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend.json --json "$OUT"/sdpa.json 2>&1 | grep -v "^append" > "$OUT"/compare.txt
cat "$OUT"/compare.txt
