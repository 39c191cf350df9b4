#!/usr/bin/env bash
# On the GPU machine (python/third_party carried: python/vendor_deps.sh here): builds the Python
# package there with its CUDA kernels, runs the device Python tests (caches, kvslim.hf on CUDA),
# then bench/cuda/hf_generate.py (HF generate: DynamicCache / StaticCache vs kvslim's device
# caches). Each result is written into $OUT as it finishes.
#   [SKIP_TESTS=1] bash bench/cuda/device_hf.sh [hf_generate.py arguments]
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
ROOT=$PWD
{ BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh 2>&1 | tail -n 5; } > "$OUT"/python_build.txt 2>&1
[ -z "${SKIP_TESTS:-}" ] && (cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 240 python3 -m pytest -q -p no:cacheprovider \
  "$ROOT"/python/tests/test_cuda.py "$ROOT"/python/tests/test_hf_cuda.py "$ROOT"/python/tests/test_hf.py \
  "$ROOT"/python/tests/test_attend.py "$ROOT"/python/tests/test_attention.py 2>&1 | tail -n 40) \
  > "$OUT"/python.txt 2>&1
tail -n 3 "$OUT"/python.txt
PYTHONPATH=/tmp/build-python/python timeout 400 python3 bench/cuda/hf_generate.py --out "$OUT" "$@" > "$OUT"/hf_generate.log 2>&1
tail -n 40 "$OUT"/hf_generate.log
