#!/usr/bin/env bash
# stop 63, call 1: the decode codes kernel's L2 prefetch (pf2 / pf4 / pf8: the unit N units ahead
# asked into L2 by one bulk prefetch a product), 3 stages, both; pending_s62's arithmetic probes
# (cmain, crawv, crawk, cpadf64, cpadf128, cpadc32); then main's attention bench against SDPA.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT"/gpu.txt 2>&1; cat "$OUT"/gpu.txt
xz -dc devbin/bins.tar.xz | tar xf - -C devbin
xz -dkf devbin/cuda_tests_pf4.xz && chmod +x devbin/cuda_tests_pf4
ARGS="bench attend --device cuda --batch 8 1 --context 32768 --head-dim 128 --cache kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
run_set() {  # file, names...
  local file=$1; shift
  for name in "$@"; do
    { echo "=== $name"; timeout 60 devbin/$name $ARGS 2>&1 | grep -E "^ *128 |rror|what"; } >> "$OUT/$file"
  done
}
run_set memory_ab.txt kvslim kvslim_pf2 kvslim_pf4 kvslim_pf8 kvslim_st3 kvslim_pf4st3 kvslim
cat "$OUT"/memory_ab.txt
timeout 100 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json "$OUT"/attend.json > "$OUT"/attend.txt 2>&1
timeout 100 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend.json --json "$OUT"/sdpa.json 2>&1 | grep -v "^append" > "$OUT"/compare.txt
cat "$OUT"/compare.txt
# pf4's correctness (the prefetch changes no result; its addresses stay inside the warp's units)
{ echo "=== cuda_tests_pf4"; timeout 110 devbin/cuda_tests_pf4 --gtest_filter='CudaAttend.*:CudaKivi.*:CudaZipcache.Attention*:CudaStepGraph.Kivi*:CudaEviction.Kivi*' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -c 8000; echo "tests exit: ${PIPESTATUS[0]}"
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests_pf4 \
    --gtest_filter='CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel:CudaKivi.*:CudaZipcache.Attention*' 2>&1 | tail -c 3000
  echo "memcheck exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests_pf4.txt 2>&1
tail -c 2500 "$OUT"/tests_pf4.txt
run_set compute_only.txt kvslim_cmain kvslim_crawv kvslim_crawk kvslim_cpadf64 kvslim_cpadf128 kvslim_cpadc32 kvslim_cmain
cat "$OUT"/compute_only.txt
