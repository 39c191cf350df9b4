#!/usr/bin/env bash
# Issue 29 on the device (python/third_party carried: python/vendor_deps.sh here). Builds the Python
# package there, then:
#   * the CPU check: test_hf_tensor_parallel.py (2 gloo ranks of a tp_plan="auto" model, GPU hidden);
#   * on 2 GPUs (nvidia-h200-x2): hf_tp_worker.py alone on GPU 0 and as 2 NCCL ranks (one GPU each,
#     kvslim's caches in GPU memory), and their comparison (tp_compare.txt).
# Everything into $OUT as it goes.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
ROOT=$(pwd)
BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh > "$OUT"/tp_build.txt 2>&1
tail -n 3 "$OUT"/tp_build.txt
export PYTHONPATH=/tmp/build-python/python
(cd /tmp && timeout 400 python3 -m pytest -q -s -p no:cacheprovider "$ROOT"/python/tests/test_hf_tensor_parallel.py) \
  > "$OUT"/tp_cpu_ranks.txt 2>&1
tail -n 14 "$OUT"/tp_cpu_ranks.txt
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -lt 2 ]; then echo "$GPUS GPU(s): the 2-GPU check needs nvidia-h200-x2" | tee "$OUT"/tp_compare.txt; exit 0; fi
W=/tmp/kvslim-tp
rm -rf "$W" && mkdir -p "$W"
python3 -c "import sys, pathlib; sys.path.insert(0, 'python/tests'); import hf_tp_worker as w; w.save_model(pathlib.Path('$W/model'))"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 python/tests/hf_tp_worker.py "$W"/model "$W"/out --device cuda \
  > "$OUT"/tp_single_gpu.txt 2>&1
timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 python/tests/hf_tp_worker.py "$W"/model "$W"/out \
  --device cuda > "$OUT"/tp_two_gpus.txt 2>&1
python3 python/tests/hf_tp_worker.py compare "$W"/out 2>&1 | tee "$OUT"/tp_compare.txt
