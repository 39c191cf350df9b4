#!/usr/bin/env bash
# On the GPU machine, devbin/ and python/third_party carried: the replayed decode step
# (kvslim.hf.GraphDecoder / StepGraph) checked first, then everything else the device checks.
# Each result is written into $OUT as it finishes (a call cut short keeps what it made).
#   bash bench/cuda/device_graph.sh [quick|kernels|greedy|bench ARGS|maxbatch ARGS]
#   quick: the graph tests and their sanitizer only; kernels: then device_run.sh quick (every kernel
#   test, memcheck, racecheck, bench attend at batch 1 / 8 x 32k; CACHES as there) and the Python GPU suite; greedy: then hf_tiny_greedy.py; bench: then
#   hf_generate.py ARGS; maxbatch: then hf_max_batch.py ARGS (no argument: every device check)
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
source bench/cuda/sanitizer_report.sh  # keep_report
ROOT=$PWD
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
xz -dkf devbin/cuda_tests.xz && chmod +x devbin/cuda_tests
# python/third_party may travel packed (devbin/third_party.tar.xz: the tree plus carried paths must stay
# under the device's 64 MiB with devbin/kvslim.xz beside it)
[ -d python/third_party ] || { [ -f devbin/third_party.tar.xz ] && tar -xJf devbin/third_party.tar.xz; }
( BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh 2>&1 | tail -n 5 ) > "$OUT"/python_build.txt 2>&1 &
BUILD_PID=$!
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: a measurement call right after a tested one
  timeout 200 devbin/cuda_tests --gtest_filter='CudaStepGraph.*:CudaEviction.*' > "$OUT"/graph_tests.txt 2>&1
  echo "graph tests exit: $?" >> "$OUT"/graph_tests.txt
  if grep -q "exit: 139" "$OUT"/graph_tests.txt && command -v gdb >/dev/null; then
    timeout 120 gdb -batch -ex run -ex bt --args devbin/cuda_tests --gtest_filter='CudaStepGraph.*' > "$OUT"/graph_gdb.txt 2>&1
  fi
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 devbin/cuda_tests \
    --gtest_filter='CudaStepGraph.*:CudaEviction.Streaming*:CudaEviction.Squeeze*:-CudaStepGraph.*LargerStores' 2>&1 \
    | keep_report > "$OUT"/graph_memcheck.txt
  echo "memcheck exit: ${PIPESTATUS[0]}" >> "$OUT"/graph_memcheck.txt
fi
wait $BUILD_PID
if [ -z "${SKIP_TESTS:-}" ]; then
  (cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 200 python3 -m pytest -q -p no:cacheprovider \
    -k "graph or streaming or squeeze or attend_and_observe" \
    "$ROOT"/python/tests/test_hf_cuda.py "$ROOT"/python/tests/test_cuda.py 2>&1 | tail -n 60) > "$OUT"/python_graph.txt 2>&1
  tail -n 3 "$OUT"/graph_tests.txt "$OUT"/graph_memcheck.txt "$OUT"/python_graph.txt
fi
[ "${1:-}" = quick ] && exit 0
if [ "${1:-}" = kernels ]; then  # every kernel test, the sanitizers and the attention bench (devbin/kvslim.xz carried), then the Python GPU suite
  bash bench/cuda/device_run.sh quick
  (cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 240 python3 -m pytest -q -p no:cacheprovider \
    "$ROOT"/python/tests/test_cuda.py "$ROOT"/python/tests/test_hf_cuda.py 2>&1 | tail -n 40) > "$OUT"/python.txt 2>&1
  tail -n 3 "$OUT"/python.txt
  exit 0
fi
if [ "${1:-}" = greedy ]; then
  PYTHONPATH=/tmp/build-python/python timeout 200 python3 bench/cuda/hf_tiny_greedy.py --out "$OUT" > "$OUT"/hf_tiny_greedy.log 2>&1
  tail -n 12 "$OUT"/hf_tiny_greedy.log
  exit 0
fi
if [ "${1:-}" = maxbatch ]; then
  shift
  PYTHONPATH=/tmp/build-python/python timeout 560 python3 bench/cuda/hf_max_batch.py --out "$OUT" "$@" > "$OUT"/hf_max_batch.log 2>&1
  tail -n 40 "$OUT"/hf_max_batch.log
  exit 0
fi
if [ "${1:-}" = bench ]; then
  shift
  PYTHONPATH=/tmp/build-python/python timeout 420 python3 bench/cuda/hf_generate.py --out "$OUT" "$@" > "$OUT"/hf_generate.log 2>&1
  tail -n 30 "$OUT"/hf_generate.log
  exit 0
fi
bash bench/cuda/device_run.sh tests
(cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 240 python3 -m pytest -q -p no:cacheprovider \
  "$ROOT"/python/tests/test_cuda.py "$ROOT"/python/tests/test_hf_cuda.py "$ROOT"/python/tests/test_hf.py \
  "$ROOT"/python/tests/test_attend.py "$ROOT"/python/tests/test_attention.py 2>&1 | tail -n 40) > "$OUT"/python.txt 2>&1
tail -n 3 "$OUT"/python.txt
