#!/usr/bin/env bash
# One device call (GPU machine with torch + transformers + tokenizers): check the golden
# models against transformers, then train + save + eval + tiny golden files.
#   OUT=<dir> BUDGET_S=<seconds> bash training/device_run.sh [extra train_tiny.py args]
# BUDGET_S must be below the call's real limit (ask the device tool's `status` for the
# time left first: the call is cut at min(timeout, time left)). train_tiny.py stops
# training --eval-reserve seconds before the deadline and copies the model into $OUT as
# soon as it is saved, so a cut call still returns the weights.
set -x
export PYTHONUNBUFFERED=1
T0=$(date +%s)
OUT="${OUT:-training/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/run.log"
timeout 120 python3 training/make_golden.py --verify 2>&1 | tee -a "$OUT/run.log"
python3 training/train_tiny.py --data training/data --out models/tiny --golden tests/golden/tiny \
  --tokenizer models/tiny/tokenizer.json --export "$OUT" \
  --deadline $((T0 + ${BUDGET_S:-570})) "$@" 2>&1 | tee -a "$OUT/run.log"
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
