#!/usr/bin/env bash
# Stop 64, revised in stop 65: the decode codes kernel with its value product on the int8 tensor cores,
# as it would land (int8_values.patch on main: kvslim_land, cuda_tests_land), against main's kernel
# (kvslim) and the landing form at 4 CTAs an SM (land4). Most telling first: the tests (the worst
# errors they print decide the two digits: README.md), the A/B against SDPA
# (bench/cuda/device_kernel_ab.sh), memcheck and racecheck, then main's and the landing form's
# 1 x 128k against SDPA.
set -u
source bench/cuda/device_prelude.sh  # OUT, the library path, gpu.txt, devbin unpacked
TESTS='CudaAttend.*:CudaKivi.*:CudaZipcache.*:CudaStepGraph.*:CudaEviction.Kivi*:CudaEviction.Zipcache*:-CudaStepGraph.*LargerStores'
{ timeout 150 devbin/cuda_tests_land --gtest_filter="$TESTS" 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 9000
  echo "tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_land.txt 2>&1
grep -E "worst error|long context|FAILED|Failure|exit" "$OUT"/tests_land.txt | head -40
# main (first and last), land, land4 at batch 1 / 8 x 32k, each beside torch SDPA
CACHES="full kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache" bash bench/cuda/device_kernel_ab.sh
{ timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests_land \
    --gtest_filter='CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel:CudaKivi.*:CudaZipcache.Attention*' 2>&1 | tail -c 3000
  echo "memcheck exit: ${PIPESTATUS[0]}"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 devbin/cuda_tests_land \
    --gtest_filter='CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel' 2>&1 | tail -c 2000
  echo "racecheck exit: ${PIPESTATUS[0]}"; } > "$OUT"/sanitizers_land.txt 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit" "$OUT"/sanitizers_land.txt
for name in kvslim_land kvslim; do  # batch 1 x 128k (the shared A/B stops at 32k)
  timeout 100 devbin/$name bench attend --device cuda --batch 1 --context 131072 --head-dim 128 \
    --cache full kivi4_g128 kivi2_g128 --json "$OUT"/attend128k_$name.json > "$OUT"/attend128k_$name.txt 2>&1
  { echo "=== $name"; timeout 100 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend128k_$name.json \
      --json "$OUT"/sdpa128k_$name.json 2>&1 | grep -v "^append"; } >> "$OUT"/compare128k.txt
done
cat "$OUT"/compare128k.txt
# Last: Nsight Compute's summaries of kivi2 at 8 x 32k, main's and the landing form's (the executed
# instructions a unit, the issue rate): whether the ~73 fewer instructions a trip the compiler counts
# are the ones the time follows.
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section InstructionStats"
for name in kvslim kvslim_land; do
  { echo "=== $name kivi2_g128"; timeout 60 ncu $NCU_SECTIONS -k regex:attend_codes -c 1 devbin/$name \
      bench attend --device cuda --context 32768 --head-dim 128 --repeats 1 --batch 8 --cache kivi2_g128; } >> "$OUT"/ncu_kivi2.txt 2>&1
done
grep -E "^===|Warp Cycles Per Issued|Issued Warp|Eligible Warps|Executed Ipc A|Executed Instructions  |Duration|Registers Per" "$OUT"/ncu_kivi2.txt | head -40
