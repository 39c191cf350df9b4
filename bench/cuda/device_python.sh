#!/usr/bin/env bash
# On the GPU machine (python/third_party carried: python/vendor_deps.sh here): builds the Python
# package there (its CMake finds nvcc, so the module has the device caches) and runs the Python
# tests, test_cuda.py's GPU tests among them. Output into $OUT.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
{ BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh 2>&1 | tail -n 5
  cd /tmp && PYTHONPATH=/tmp/build-python/python timeout 200 python3 -m pytest -q -p no:cacheprovider \
    "$OLDPWD"/python/tests/test_cuda.py "$OLDPWD"/python/tests/test_attend.py 2>&1 | tail -n 15; } > "$OUT"/python.txt 2>&1
tail -n 8 "$OUT"/python.txt
