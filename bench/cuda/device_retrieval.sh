#!/usr/bin/env bash
# On the GPU machine (devbin/ and python/third_party carried): the retrieval episodes of
# `kvslim eval --model models/tiny` (quick preset), dumped by the CLI, answered through
# transformers + kvslim.hf with every cache on the GPU and on the CPU (bench/cuda/hf_retrieval.py).
# Results in $OUT as they come.
#   bash bench/cuda/device_retrieval.sh [hf_retrieval.py arguments]
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f devbin/kvslim.xz ] && xz -dkf devbin/kvslim.xz && chmod +x devbin/kvslim
{ BUILD=/tmp/build-python JOBS=16 timeout 300 python/build.sh 2>&1 | tail -n 5; } > "$OUT"/python_build.txt 2>&1
devbin/kvslim eval --model models/tiny --dump-episodes "$OUT"/episodes.jsonl > "$OUT"/episodes.txt 2>&1
PYTHONPATH=/tmp/build-python/python timeout 450 python3 bench/cuda/hf_retrieval.py --episodes "$OUT"/episodes.jsonl \
  --out "$OUT" "$@" > "$OUT"/hf_retrieval.log 2>&1
tail -n 40 "$OUT"/hf_retrieval.log
