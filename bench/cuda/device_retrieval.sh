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
# EPISODES: a file dumped beforehand (e.g. docs/benchmarks/cuda/retrieval_episodes.jsonl, passkey and
# kvlist at 1k tokens); else the quick preset's, dumped here by devbin/kvslim.
if [ -z "${EPISODES:-}" ]; then
  EPISODES="$OUT"/episodes.jsonl
  devbin/kvslim eval --model models/tiny --dump-episodes "$EPISODES" > "$OUT"/episodes.txt 2>&1
fi
PYTHONPATH=/tmp/build-python/python timeout ${RETRIEVAL_TIMEOUT:-450} python3 bench/cuda/hf_retrieval.py --episodes "$EPISODES" \
  --out "$OUT" "$@" > "$OUT"/hf_retrieval.log 2>&1
tail -n 40 "$OUT"/hf_retrieval.log
