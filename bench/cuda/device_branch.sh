#!/usr/bin/env bash
# A branch's first call on the GPU machine (devbin/ and python/third_party carried, models/tiny
# moved out of the tree): what it must pass, then what it must measure, most important first, in
# one call of at most 600 s (each step with its own timeout; every result written into $OUT as it
# finishes, so a call cut short keeps what it made):
#   tests.txt        every CUDA test, then the graph and eviction tests with the segments merging
#                    (KVSLIM_CUDA_FUSED_MERGE=1), compute-sanitizer memcheck over the graph, eviction
#                    and cache tests, racecheck over the decode codes kernel's tests (after the
#                    benches), the Python GPU tests (graph, streaming, squeeze, attend_and_observe)
#   attend.txt       kvslim bench attend at batch 1 and 8 x 32k and 128k (CACHES), eager and replayed as a
#                    CUDA graph, and torch SDPA both ways (compare.txt), while Python builds
#                    (compare.txt also: the A/B of devbin/kvslim_base, the branch's base, when carried)
#   hf_generate.txt  (not with SKIP_GEN=1) 8 layers of Llama-3-8B's shape at 1 x 32k: h2o keeping 25 % over fp16 slots and
#                    over kivi K4V2 g128 and over zipcache, squeeze over zipcache (GEN_ONLY: the
#                    labels to run), replayed steps (hf_generate_unread_probs_written.txt: the
#                    same with the decode probabilities written, KVSLIM_CUDA_UNREAD_PROBS=0)
# At most 7 files in $OUT: the device brings back 8.
#   bash bench/cuda/device_branch.sh
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
source bench/cuda/sanitizer_report.sh  # keep_report
ROOT=$PWD
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in devbin/kvslim.xz devbin/cuda_tests.xz; do xz -dkf "$f"; done
chmod +x devbin/kvslim devbin/cuda_tests
[ -f devbin/kvslim_base.xz ] && xz -dkf devbin/kvslim_base.xz && chmod +x devbin/kvslim_base
[ -d python/third_party ] || { [ -f devbin/third_party.tar.xz ] && tar -xJf devbin/third_party.tar.xz; }
( BUILD=/tmp/build-python JOBS=8 timeout 300 python/build.sh 2>&1 | tail -n 5 ) > "$OUT"/python_build.txt 2>&1 &
BUILD_PID=$!
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  timeout 150 devbin/cuda_tests 2>&1 | grep -v "^\[       OK\|^\[ RUN" | tail -c 40000
  echo "tests exit: ${PIPESTATUS[0]}"
  echo "=== graph and eviction tests with the partials merged in the segments (KVSLIM_CUDA_FUSED_MERGE=1)"
  KVSLIM_CUDA_FUSED_MERGE=1 timeout 60 devbin/cuda_tests --gtest_filter='CudaStepGraph.*:CudaEviction.*:-CudaStepGraph.*LargerStores' 2>&1 \
    | grep -v "^\[       OK\|^\[ RUN" | tail -c 8000
  echo "fused merge tests exit: ${PIPESTATUS[0]}"; } > "$OUT"/tests.txt 2>&1
{ echo "=== compute-sanitizer memcheck"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:CudaEviction.Zipcache*:CudaCache.*:-CudaStepGraph.*LargerStores' 2>&1 | keep_report
  echo "memcheck exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests.txt 2>&1
# The attention bench while Python builds (8 of the 16 cores: the bench's host thread keeps one):
# eager calls and the same calls replayed as a CUDA graph, against torch SDPA both ways
# SKIP_ATTEND=1 leaves the attention bench out (a branch that does not touch the attention kernels).
ATTEND=(--batch 1 8 --context 32768 131072 --head-dim 128 --cache ${CACHES:-full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache zipcache@zipcache_value_bits=2})
if [ "${SKIP_ATTEND:-0}" != 1 ]; then
  timeout 150 devbin/kvslim bench attend --device cuda "${ATTEND[@]}" --json "$OUT"/attend.json >> "$OUT"/attend.txt 2>&1
  timeout 120 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend.json >> "$OUT"/compare.txt 2>&1
fi
# A/B: devbin/kvslim_base (the branch's base, when carried) at batch 1 and 8 x 32k, right after
if [ -x devbin/kvslim_base ]; then
  for bin in kvslim_base kvslim; do
    echo "=== A/B: devbin/$bin" >> "$OUT"/compare.txt
    timeout 60 devbin/$bin bench attend --device cuda --batch 1 8 --context 32768 --head-dim 128 \
      --cache ${AB_CACHES:-kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache} 2>&1 | grep -v "^graph timing" >> "$OUT"/compare.txt
  done
fi
# Racecheck over the tests that run the decode codes kernel and the merge (2/4/8 bits, groups of one
# and several units, own lengths, zipcache's sets, eviction over codes): ~150 s on an H100.
{ echo "=== compute-sanitizer racecheck"
  timeout 200 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaAttend.ScoresClimbing*:CudaAttend.BatchWithOwnLengths*:CudaZipcache.Attention*:CudaEviction.KiviCodesUnderH2o*' 2>&1 \
    | keep_report
  echo "racecheck exit: ${PIPESTATUS[0]}"; } >> "$OUT"/tests.txt 2>&1
wait $BUILD_PID
cat "$OUT"/python_build.txt >> "$OUT"/tests.txt; rm -f "$OUT"/python_build.txt
(echo "=== Python GPU tests"; cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 120 python3 -m pytest -q -p no:cacheprovider \
  -k "graph or streaming or squeeze or attend_and_observe" \
  "$ROOT"/python/tests/test_hf_cuda.py "$ROOT"/python/tests/test_cuda.py 2>&1 | tail -n 40) >> "$OUT"/tests.txt 2>&1
# SKIP_GEN=1 leaves the transformers step out (a branch that touches neither the step nor its kernels).
if [ "${SKIP_GEN:-0}" != 1 ]; then
  GEN_ARGS=(--skip tiny --shapes 1x32768 --static-limit 0 --new-tokens 48)
  PYTHONPATH=/tmp/build-python/python timeout ${GEN_TIMEOUT:-120} python3 bench/cuda/hf_generate.py --out "$OUT" "${GEN_ARGS[@]}" \
    --only "${GEN_ONLY:-h2o 25%,streaming 25%}" > "$OUT"/hf_generate.log 2>&1
  mkdir -p /tmp/ab_unread
  KVSLIM_CUDA_UNREAD_PROBS=0 PYTHONPATH=/tmp/build-python/python timeout 80 python3 bench/cuda/hf_generate.py \
    --out /tmp/ab_unread "${GEN_ARGS[@]}" --only "over kivi K4V2 g128 (cuda graph)" > /tmp/ab_unread/hf_generate.log 2>&1
  cp /tmp/ab_unread/hf_generate.txt "$OUT"/hf_generate_unread_probs_written.txt
  rm -f "$OUT"/hf_generate.log
fi
grep -E "exit|PASSED|FAILED|passed|failed|ERROR SUMMARY" "$OUT"/tests.txt
[ -f "$OUT"/hf_generate.txt ] && grep -E "replay|observe_packed" "$OUT"/hf_generate.txt "$OUT"/hf_generate_unread_probs_written.txt | cut -c 1-400
cat "$OUT"/compare.txt
