#!/usr/bin/env bash
# One command on the GPU machine (Python 3.12, torch, transformers 5.x, a C++20 compiler; no apt,
# no network): builds the kvslim package from this repository and runs python/tests/gpu_hf_check.py.
# Bring python/third_party along (python/vendor_deps.sh on the Debian machine) in case the GPU machine
# lacks pybind11 or Highway. Output: python/tests/gpu_hf_check.txt (+ .json), also copied to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build-python} PYTHON=$PYTHON python/build.sh
status=0
PYTHONPATH="${BUILD:-build-python}/python" "$PYTHON" python/tests/gpu_hf_check.py --out python/tests/gpu_hf_check.txt "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp python/tests/gpu_hf_check.txt python/tests/gpu_hf_check.json "$OUT/" 2>/dev/null || true; fi
exit $status
