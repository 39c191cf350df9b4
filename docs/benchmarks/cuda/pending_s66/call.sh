#!/usr/bin/env bash
# Stop 65's second call: the landing form with the softmax's sum back to P's own (the zero points by
# the rounded P'): its tests, then main / land / main at batch 8 and 1 x 32k.
set -u
source bench/cuda/device_prelude.sh >/dev/null 2>&1
TESTS='CudaAttend.*:CudaKivi.*:CudaZipcache.*:CudaStepGraph.*:CudaEviction.Kivi*:CudaEviction.Zipcache*:-CudaStepGraph.*LargerStores'
{ timeout 170 devbin/cuda_tests_land --gtest_filter="$TESTS" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 20000
  echo "tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_land.txt 2>&1
grep -E "worst error|long context|FAILED|PASSED|exit" "$OUT"/tests_land.txt | head -30
grep -m5 -A5 "Failure" "$OUT"/tests_land.txt
for name in kvslim kvslim_land kvslim; do
  { echo "=== $name"; timeout 60 devbin/$name bench attend --device cuda --batch 8 1 --context 32768 --head-dim 128 \
      --cache kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache 2>&1 | grep -E "^ *128 |rror|what"; } >> "$OUT"/ab.txt
done
cat "$OUT"/ab.txt
