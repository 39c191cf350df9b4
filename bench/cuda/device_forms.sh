#!/usr/bin/env bash
# The fp16 codes kernel's forms (KVSLIM_CUDA_HALF_FORM = base | lean | lean_int_keys,
# src/kvslim/cuda/attend_codes_half.cu) on the GPU machine, in one call of at most 600 s (devbin/
# carried, models/tiny moved out of the tree; each step with its own timeout, every result written
# into $OUT as it finishes):
#   tests.txt    the suites that decode through the kernel (attention, zipcache, graph, eviction
#                over kivi codes, streaming) under lean and under lean_int_keys (base: every CUDA
#                test, bench/cuda/device_branch.sh), then compute-sanitizer memcheck over the
#                attention and graph tests under each
#   compare.txt  kvslim bench attend at batch 1 and 8 x 32k (D 128) for each form in turn, twice
#                (base, lean, lean_int_keys, base, ...), eager and replayed; torch SDPA at the same
#                shapes once, after
#   bash bench/cuda/device_forms.sh
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/kvslim.xz devbin/cuda_tests.xz; do [ -x "${f%.xz}" ] || xz -dkf "$f"; done
chmod +x devbin/kvslim devbin/cuda_tests
FORMS=(lean lean_int_keys)
FILTER='CudaAttend.*:CudaZipcache.*:CudaStepGraph.*:CudaEviction.Kivi*:CudaEviction.Streaming*:-CudaStepGraph.*LargerStores'
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  for form in "${FORMS[@]}"; do
    echo "=== tests, KVSLIM_CUDA_HALF_FORM=$form"
    KVSLIM_CUDA_HALF_FORM=$form timeout 90 devbin/cuda_tests --gtest_filter="$FILTER" 2>&1 \
      | grep -v "^\[       OK\|^\[ RUN" | tail -c 6000
    echo "tests ($form) exit: ${PIPESTATUS[0]}"
  done; } > "$OUT"/tests.txt 2>&1
ARGS=(--batch 1 8 --context 32768 --head-dim 128 --cache ${CACHES:-kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache})
for round in 1 2; do
  for form in base "${FORMS[@]}"; do
    echo "=== KVSLIM_CUDA_HALF_FORM=$form (round $round)" >> "$OUT"/compare.txt
    KVSLIM_CUDA_HALF_FORM=$form timeout 60 devbin/kvslim bench attend --device cuda "${ARGS[@]}" \
      --json /tmp/forms_$form.json 2>&1 | grep -v "^graph timing" >> "$OUT"/compare.txt
  done
done
timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/forms_base.json >> "$OUT"/compare.txt 2>&1
for form in "${FORMS[@]}"; do
  { echo "=== compute-sanitizer memcheck, KVSLIM_CUDA_HALF_FORM=$form"
    KVSLIM_CUDA_HALF_FORM=$form timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
      --gtest_filter='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*:CudaZipcache.Attention*:CudaStepGraph.Kivi*' \
      2>&1 | tail -n 8
    echo "memcheck ($form) exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests.txt 2>&1
done
grep -E "exit|FAILED|ERROR SUMMARY" "$OUT"/tests.txt
cat "$OUT"/compare.txt
