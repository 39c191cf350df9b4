#!/usr/bin/env bash
# On the GPU machine, with devbin/ carried (bench/cuda/build_devbin.sh): the CUDA test suite, the
# same suite under compute-sanitizer (memcheck; racecheck on the shared-memory kernels), then
# `kvslim bench attend --device cuda` and torch SDPA at the same shapes, and optionally Nsight
# Compute on one launch of each attention kernel. Each result is written into $OUT as it finishes,
# so a call cut short still brings back what it made.
#
#   [CACHES="full kivi2 ..."] [COMPARE_INT8=1] [COMPARE_MERGE=1] bash bench/cuda/device_run.sh [tests|quick|mid|all] [profile]
#     COMPARE_INT8=1: the bench again with decode on the int8 codes kernel, then on the fp16 one
#     COMPARE_MERGE=1: the bench again with the partials merged in the segments, then by
#       combine_kernel again (KVSLIM_CUDA_FUSED_MERGE=1 / 0)
#     tests: the tests and sanitizers only
#     quick: batch 1, 8 at 32k (D 128); mid: batch 1, 8, 32 at 32k and 128k (D 128); all: every shape
#     profile: also Nsight Compute (32k, D=128) into ncu.txt and ncu_sass.csv (below)
set -u
MODE=${1:-all}
source bench/cuda/device_prelude.sh  # OUT, the library path, gpu.txt, devbin unpacked
source bench/cuda/sanitizer_report.sh  # keep_report
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -2;
  python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT"/tests.txt 2>&1
timeout 240 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 60000 >> "$OUT"/tests.txt
echo "tests exit: ${PIPESTATUS[0]}" >> "$OUT"/tests.txt
# Decode runs the fp16 codes kernel; the int8 kernel (prefill, > 4 query vectors per KV head) is
# tested at decode shapes too, forced by KVSLIM_CUDA_DECODE_CODES=int8.
{ echo "=== attention tests with decode on the int8 codes kernel (KVSLIM_CUDA_DECODE_CODES=int8)"
  KVSLIM_CUDA_DECODE_CODES=int8 timeout 120 devbin/cuda_tests --gtest_filter='CudaAttend.*:CudaStepGraph.Kivi*' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -c 20000
  echo "int8 tests exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests.txt
# The suite merges each call's partials by combine_kernel (the default); replayed steps and the
# eviction paths again with the segments merging them (KVSLIM_CUDA_FUSED_MERGE=1).
{ echo "=== graph and eviction tests with the partials merged in the segments (KVSLIM_CUDA_FUSED_MERGE=1)"
  KVSLIM_CUDA_FUSED_MERGE=1 timeout 120 devbin/cuda_tests --gtest_filter='CudaStepGraph.*:CudaEviction.*:-CudaStepGraph.*LargerStores' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -c 20000
  echo "fused merge tests exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests.txt
SAN="CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel:CudaCache.*:CudaKivi.*"
SAN="$SAN:CudaEviction.Keeps*:CudaEviction.Pyramid*:CudaEviction.AnUnobserved*:CudaEviction.Kivi*:CudaEviction.SqueezeOverKivi*"
SAN="$SAN:CudaStepGraph.*:CudaZipcache.SaliencyAndCodes*:CudaZipcache.Probabilities*:CudaSelectLowest.*"
SAN="$SAN:CudaEviction.ThePromptIsScored*:CudaEviction.ANonFinitePrompt*"
SAN="$SAN:-CudaStepGraph.*LargerStores:CudaEviction.*SeveralChunks"
{ timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests --gtest_filter="$SAN" 2>&1 | keep_report
  echo "memcheck exit: ${PIPESTATUS[0]}"
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter=CudaAttend.ZeroQueryAndFlatGroups:CudaAttend.BatchWithOwnLengthsAtTheKernelLevel:CudaZipcache.Probabilities* 2>&1 | keep_report
  echo "racecheck exit: ${PIPESTATUS[0]}"
  # The shared-memory kernels of squeeze's trims (the selection, the hole filling) and the decode
  # observation. (The kivi eviction tests ran past 90 s under racecheck in stop 44: not here.)
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaEviction.SqueezeResolves*' 2>&1 | keep_report
  echo "racecheck (eviction) exit: ${PIPESTATUS[0]}"; } > "$OUT"/sanitizer.txt
if [ "$MODE" = tests ]; then tail -n 5 "$OUT"/tests.txt; grep "worst error\|long context" "$OUT"/tests.txt; tail -n 4 "$OUT"/sanitizer.txt; exit 0; fi
BENCH_ARGS=""
BENCH_TIMEOUT=300
[ "$MODE" = quick ] && { BENCH_ARGS="--batch 1 8 --context 32768 --head-dim 128"; BENCH_TIMEOUT=90; }
[ "$MODE" = mid ] && { BENCH_ARGS="--batch 1 8 32 --context 32768 131072 --head-dim 128"; BENCH_TIMEOUT=120; }
# CACHES="kivi2 kivi_k4v2_g128 ...": the caches measured (default: the bench's own list)
[ -n "${CACHES:-}" ] && BENCH_ARGS="$BENCH_ARGS --cache $CACHES"
timeout $BENCH_TIMEOUT devbin/kvslim bench attend --device cuda $BENCH_ARGS --json "$OUT"/attend_cuda.json > "$OUT"/attend_cuda.txt 2>&1
timeout $BENCH_TIMEOUT python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend_cuda.json --json "$OUT"/sdpa.json > "$OUT"/compare.txt 2>&1
# The bench again with VAR=value for each value (an A/B in one call), appended to attend_cuda.txt
# and compare.txt under a heading.
bench_passes() {
  local var=$1; shift
  for pass in "$@"; do
    env "$var=$pass" timeout $BENCH_TIMEOUT devbin/kvslim bench attend --device cuda $BENCH_ARGS \
      --json /tmp/attend_$var$pass.json >> "$OUT"/attend_cuda.txt 2>&1
    { echo "=== $var=$pass"
      timeout $BENCH_TIMEOUT python3 bench/cuda/sdpa_bench.py --kvslim /tmp/attend_$var$pass.json --json /tmp/sdpa_$var$pass.json; } \
      >> "$OUT"/compare.txt 2>&1
  done
}
# decode on the int8 codes kernel, then the fp16 one again
[ -n "${COMPARE_INT8:-}" ] && bench_passes KVSLIM_CUDA_DECODE_CODES int8 fp16
# the partials merged by combine_kernel, then in the segments again
[ -n "${COMPARE_MERGE:-}" ] && bench_passes KVSLIM_CUDA_FUSED_MERGE 1 0
if [ "${2:-}" = profile ]; then
  # ncu.txt: the codes kernel at batch 8 (sections), then every kernel's duration of one batch-1 call
  # (codes, window, merge) for kivi4 and full; ncu_sass.csv: the codes kernel's SASS with executed
  # instructions and stall samples per line.
  # PROFILE_CACHE: the cache whose codes kernel is profiled (default kivi4)
  PC=${PROFILE_CACHE:-kivi4}
  NCU_ARGS="devbin/kvslim bench attend --device cuda --context 32768 --head-dim 128 --repeats 1"
  { timeout 90 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section InstructionStats -k regex:attend_codes -c 1 $NCU_ARGS --batch 8 --cache $PC
    for c in $PC full; do
      timeout 60 ncu --section SpeedOfLight -k regex:"attend|combine" -c 6 $NCU_ARGS --batch 1 --cache $c | grep -E "attend|combine|Duration|DRAM Through"
    done; } > "$OUT"/ncu.txt 2>&1
  timeout 90 ncu --section SourceCounters --section WarpStateStats -k regex:attend_codes -c 1 --page source --print-source sass \
    --csv $NCU_ARGS --batch 8 --cache $PC > "$OUT"/ncu_sass.csv 2>&1
fi
tail -n 5 "$OUT"/tests.txt; grep "worst error\|long context" "$OUT"/tests.txt; tail -n 4 "$OUT"/sanitizer.txt; cat "$OUT"/compare.txt
