#!/usr/bin/env bash
# Stop 66's fourth call: the decode codes kernel for 32-row groups too (KVSLIM_HALF_ONE_UNIT_GROUPS=1:
# kvslim_g1, cuda_tests_g1) against main (which keeps them on the int8 kernel): the tests' worst
# errors on it, then main / g1 / main beside SDPA at batch 1 and 8 x 32k, and both at 128k.
set -u
source bench/cuda/device_prelude.sh >/dev/null 2>&1
TESTS='CudaAttend.*:CudaKivi.*:CudaStepGraph.*:CudaEviction.Kivi*:CudaEviction.Streaming*:-CudaStepGraph.*LargerStores'
{ timeout 150 devbin/cuda_tests_g1 --gtest_filter="$TESTS" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 12000
  echo "tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_g1.txt 2>&1
grep -E "worst error|long context|FAILED|PASSED|exit" "$OUT"/tests_g1.txt | head -40
{ timeout 120 devbin/cuda_tests --gtest_filter="$TESTS" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 6000
  echo "tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_main.txt 2>&1
grep -E "FAILED|PASSED|exit" "$OUT"/tests_main.txt | head -10
C="kivi2 kivi4 kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
for name in kvslim kvslim_g1 kvslim; do
  { echo "=== $name"
    timeout 90 devbin/$name bench attend --device cuda --batch 1 8 --context 32768 --head-dim 128 --cache full $C --json /tmp/ab_$name.json > /tmp/ab_$name.txt 2>&1 &&
    timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/ab_$name.json --json /tmp/ab_sdpa.json 2>&1 | grep -v "^append"; } >> "$OUT"/ab_compare.txt
done
for name in kvslim_g1 kvslim; do
  { echo "=== $name 128k"
    timeout 120 devbin/$name bench attend --device cuda --batch 1 8 --context 131072 --head-dim 128 --cache full kivi2 kivi4 kivi2_g128 kivi4_g128 --json /tmp/l_$name.json > /dev/null 2>&1 &&
    timeout 120 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/l_$name.json --json /tmp/l_sdpa.json 2>&1 | grep -v "^append"; } >> "$OUT"/compare128k.txt
done
cat "$OUT"/ab_compare.txt "$OUT"/compare128k.txt | grep -v "^#"
