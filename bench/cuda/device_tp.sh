#!/usr/bin/env bash
# Issue 29 on the device (python/third_party carried: python/vendor_deps.sh here). Builds the Python
# package there, then
#   check (default):
#     * test_hf_tensor_parallel.py: 2 gloo ranks of a tp_plan="auto" model on the CPU (GPU hidden);
#     * on 2 GPUs (nvidia-h200-x2): hf_tp_worker.py alone on GPU 0 and as 2 NCCL ranks (kvslim's
#       caches in GPU memory), and their comparison (tp_compare.txt);
#   bench [ARGS]: hf_tp_generate.py on one GPU, then on 2 GPUs (ARGS passed to both, e.g.
#     --shapes 8x32768 --only kivi2), and the ratios (tp_bench_compare.txt).
# Everything into $OUT as it goes.
set -u
MODE=${1:-check}
shift || true
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
ROOT=$(pwd)
BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh > "$OUT"/tp_build.txt 2>&1
tail -n 3 "$OUT"/tp_build.txt
export PYTHONPATH=/tmp/build-python/python
GPUS=$(nvidia-smi -L | wc -l)
W=/tmp/kvslim-tp
if [ "$MODE" = check ]; then
  (cd /tmp && timeout 400 python3 -m pytest -q -s -p no:cacheprovider "$ROOT"/python/tests/test_hf_tensor_parallel.py) \
    > "$OUT"/tp_cpu_ranks.txt 2>&1
  tail -n 14 "$OUT"/tp_cpu_ranks.txt
  if [ "$GPUS" -lt 2 ]; then echo "$GPUS GPU(s): the 2-GPU check needs nvidia-h200-x2" | tee "$OUT"/tp_compare.txt; exit 0; fi
  rm -rf "$W" && mkdir -p "$W"
  python3 -c "import sys, pathlib; sys.path.insert(0, 'python/tests'); import hf_tp_worker as w; w.save_model(pathlib.Path('$W/model'))"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 python/tests/hf_tp_worker.py "$W"/model "$W"/out --device cuda \
    > "$OUT"/tp_single_gpu.txt 2>&1
  timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 python/tests/hf_tp_worker.py "$W"/model "$W"/out \
    --device cuda > "$OUT"/tp_two_gpus.txt 2>&1
  python3 python/tests/hf_tp_worker.py compare "$W"/out 2>&1 | tee "$OUT"/tp_compare.txt
else
  if [ "$GPUS" -lt 2 ]; then echo "$GPUS GPU(s): the benchmark needs nvidia-h200-x2"; exit 1; fi
  [ -d "$W"/l8b ] || python3 bench/cuda/hf_tp_generate.py --save "$W"/l8b > "$OUT"/tp_one.log 2>&1
  CUDA_VISIBLE_DEVICES=0 python3 bench/cuda/hf_tp_generate.py --model-dir "$W"/l8b --out "$OUT"/tp_one "$@" \
    >> "$OUT"/tp_one.log 2>&1
  python3 -m torch.distributed.run --nproc-per-node 2 bench/cuda/hf_tp_generate.py --model-dir "$W"/l8b \
    --out "$OUT"/tp_two "$@" > "$OUT"/tp_two.log 2>&1
  python3 bench/cuda/hf_tp_generate.py --compare "$OUT"/tp_one "$OUT"/tp_two 2>&1 | tee "$OUT"/tp_bench_compare.txt
fi
