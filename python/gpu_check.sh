#!/usr/bin/env bash
# One command on the GPU machine (Python 3.12, torch, transformers 5.x, a C++20 compiler; no apt,
# no network): builds the kvslim package from this repository and runs python/tests/gpu_hf_check.py.
# Bring python/third_party along (python/vendor_deps.sh on the Debian machine) in case the GPU machine
# lacks pybind11 or Highway. Output: python/tests/gpu_hf_check.txt (+ .json), also copied to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build-python} PYTHON=$PYTHON python/build.sh
# torch and kvslim in one process, both import orders (a crash here once came from pybind11
# internals shared with torch's; see python/CMakeLists.txt). Each in its own process so that a
# crash is reported, not fatal to the check.
"$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'pybind11 of torch:', getattr(torch._C, '_PYBIND11_COMPILER_TYPE', '?'), getattr(torch._C, '_PYBIND11_STDLIB', '?'), getattr(torch._C, '_PYBIND11_BUILD_ABI', '?'))" || true
for order in "import torch, kvslim" "import kvslim, torch"; do
  PYTHONPATH="${BUILD:-build-python}/python" "$PYTHON" -X faulthandler -c "$order
c = kvslim.Config(method='kivi')
try:
    kvslim.Config(method='no-such-method')
except kvslim.ConfigError as e:
    print('error translated:', e)
print('$order: ok')" || { echo "gpu_check: '$order' failed"; exit 1; }
done
status=0
PYTHONPATH="${BUILD:-build-python}/python" "$PYTHON" python/tests/gpu_hf_check.py --out python/tests/gpu_hf_check.txt "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp python/tests/gpu_hf_check.txt python/tests/gpu_hf_check.json "$OUT/" 2>/dev/null || true; fi
exit $status
