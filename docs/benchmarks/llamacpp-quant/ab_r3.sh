#!/usr/bin/env bash
# Issue 28, third run: decode A/B of two kvslim binaries (OLD: main before this change, NEW: branch
# issue28c) against llama.cpp, in alternating rounds: each round runs, for every weight type and
# thread count, llama-bench, then OLD, then NEW (the next round the same order), so that the load
# of this shared machine hits the three alike. The commands are quant.sh's (the protocol):
#   llama-bench -m F -t T -fa 1 -p 512 -n 32 -r 2 -o json
#   kvslim bench engine --model F --threads T --repeats 2 --decode-tokens 32 --context 512 --method full
# Best of rounds (and of each run's repetitions) for every engine; summary: ab_r3_summary.py.
#   OLD=... NEW=... LLAMACPP_BIN=... CACHE=... ROUNDS=3 [FIRST_ROUND=1] ab_r3.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: ab_r3.sh OUT_DIR}
ROUNDS=${ROUNDS:-3}
TYPES=${TYPES:-"q4_0 q8_0 q4_k_m"}
THREADS_LIST=${THREADS_LIST:-"2 1"}
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }
# QUIET_GATE=S (seventh run; default off): before each engine's run, wait up to S seconds until the
# machine's CPUs are at most QUIET_BUSY % busy (default 15) over 2 s (/proc/stat), i.e. until no
# other process holds a core; logged either way, so a run that did not get a quiet machine is marked.
busy_pct() {  # CPU busy % over 2 s
  local a b
  a=($(head -1 /proc/stat)); sleep 2; b=($(head -1 /proc/stat))
  local tot=0 idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) i
  for i in 1 2 3 4 5 6 7 8; do tot=$(( tot + b[i] - a[i] )); done
  echo $(( tot > 0 ? 100 * (tot - idle) / tot : 0 ))
}
gate() {
  [[ -n ${QUIET_GATE:-} ]] || return 0
  local start=$SECONDS b
  while :; do
    b=$(busy_pct)
    if (( b <= ${QUIET_BUSY:-15} )); then log "gate: quiet ($b % busy, waited $((SECONDS - start)) s)"; return 0; fi
    if (( SECONDS - start >= QUIET_GATE )); then log "gate: NOT quiet after $((SECONDS - start)) s ($b % busy)"; return 0; fi
  done
}
for round in $(seq "${FIRST_ROUND:-1}" "$ROUNDS"); do
  for t in $TYPES; do
    f=$CACHE/random-1b-$t.gguf
    for th in $THREADS_LIST; do
      tag=${t}_t${th}_r$round
      log "round $round: $t, $th threads (load $(cut -d' ' -f1-3 /proc/loadavg))"
      gate
      "$LLAMACPP_BIN/llama-bench" -m "$f" -t "$th" -fa 1 -p 512 -n 32 -r 2 -o json > "$OUT/llama_$tag.json"
      for which in old new; do
        bin=$OLD
        [[ $which == new ]] && bin=$NEW
        gate
        "$bin" bench engine --model "$f" --threads "$th" --repeats 2 --decode-tokens 32 --context 512 --method full \
          --json "$OUT/kvslim_${which}_$tag.json" > "$OUT/kvslim_${which}_$tag.txt"
      done
    done
  done
done
log "done (load $(cut -d' ' -f1-3 /proc/loadavg))"
