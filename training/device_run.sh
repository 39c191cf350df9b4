#!/usr/bin/env bash
# The GPU recipe of models/tiny, as one training run that spans two device calls (each call is
# limited to 10 minutes; a detached process keeps training while the machine stays held).
#
#   call 1:  run(command="OUT=$OUT bash training/device_run.sh start", carry=["training/data"], timeout_s=600)
#   call 2:  run(command="OUT=$OUT bash training/device_run.sh collect", timeout_s=600)   -- at once
#
# start:   a smoke run (a few steps, every stage: data, save, eval, golden) must pass first; then
#          the real run starts detached (setsid) with a deadline TOTAL_S seconds from the call's
#          start, and the call returns after CALL_S seconds with the newest checkpoint in $OUT
#          (train_tiny.py exports weights every --ckpt-every seconds), so a second call that never
#          comes still leaves a usable model.
# collect: waits for the run to finish (or CALL_S seconds), then returns the final weights,
#          bundle.tgz (config, eval_hf.json, golden files) and the logs.
# Files in $OUT: the safetensors shards, bundle.tgz (unpack in the repo root), main.log, smoke.log.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
T0=$(date +%s)
OUT="${OUT:-training/out/call}"
CALL_S="${CALL_S:-585}"
TOTAL_S="${TOTAL_S:-1150}"
WORK=training/out
mkdir -p "$OUT" "$WORK/export"

copy_out() {
  cp -f "$WORK"/export/* "$OUT"/ 2>/dev/null
  cp -f "$WORK"/main.log "$OUT"/main.log 2>/dev/null
  ls -la "$OUT"
}

case "${1:-}" in
start)
  nvidia-smi --query-gpu=name,memory.total --format=csv
  if ! timeout 240 python3 training/train_tiny.py --smoke --data training/data --out "$WORK/smoke" \
        --golden "$WORK/smoke_golden" --tokenizer models/tiny/tokenizer.json --workers 4 \
        --deadline $((T0 + 230)) --eval-reserve 60 > "$OUT/smoke.log" 2>&1; then
    tail -n 60 "$OUT/smoke.log"
    echo "SMOKE RUN FAILED: the real run was not started"
    exit 1
  fi
  tail -n 12 "$OUT/smoke.log"
  echo "smoke run passed in $(( $(date +%s) - T0 )) s"
  setsid nohup python3 training/train_tiny.py --data training/data --out models/tiny --golden tests/golden/tiny \
    --tokenizer models/tiny/tokenizer.json --export "$WORK/export" --deadline $((T0 + TOTAL_S)) \
    --eval-reserve 150 "${@:2}" > "$WORK/main.log" 2>&1 < /dev/null &
  echo $! > "$WORK/main.pid"
  while [ $(( $(date +%s) - T0 )) -lt "$CALL_S" ]; do
    sleep 10
    kill -0 "$(cat "$WORK/main.pid")" 2>/dev/null || break
  done
  tail -n 25 "$WORK/main.log"
  copy_out
  ;;
collect)
  if [ ! -f "$WORK/main.pid" ]; then
    echo "no training run on this machine (it was given back between the calls)"
    exit 2
  fi
  while kill -0 "$(cat "$WORK/main.pid")" 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "$CALL_S" ]; do
    sleep 5
  done
  tail -n 60 "$WORK/main.log"
  if ! kill -0 "$(cat "$WORK/main.pid")" 2>/dev/null && [ -f tests/golden/tiny/golden.json ]; then
    timeout 120 python3 training/golden_fp16kv.py && tar czf "$OUT/golden.tgz" tests/golden/tiny
  fi
  copy_out
  ;;
*)
  echo "usage: OUT=<dir> bash training/device_run.sh start|collect [extra train_tiny.py args]"
  exit 2
  ;;
esac
echo "call took $(( $(date +%s) - T0 )) s"
