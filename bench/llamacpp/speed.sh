#!/usr/bin/env bash
# kvslim against llama.cpp, speed only, in one run: the same F16 GGUF, machine and thread counts.
# llama-bench (flash attention on) measures prefill (-p) and decode at depth (-n -d) with f16, q8_0
# and q4_0 KV; `kvslim bench engine` measures prefill and decode at the same contexts with the full
# cache and its compressed ones (one prefill shared by them: --shared-prefill). kvslim's prefill
# products run on OpenBLAS, whose kernels this machine's environment may pin (OPENBLAS_CORETYPE,
# OPENBLAS_L2_SIZE; see /work/.library/env): kvslim runs once as pinned and once with both unset
# (OpenBLAS's own choice for this CPU), and each output names the kernels it ran.
#
#   bench/llamacpp/speed.sh MODEL_DIR OUT_DIR
# Environment: THREADS_LIST ("1 2"), CONTEXTS ("128 512 1024 1984"), REPEATS (3), ROUNDS (3), DECODE_TOKENS (32),
# KVSLIM (build/bin/kvslim), LLAMACPP_BIN (default: bench/llamacpp/build_llamacpp.sh's build).
# Output: OUT_DIR/llama_*.json, kvslim_*.txt / .json per round and summary.md (the table with ratios).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?usage: speed.sh MODEL_DIR OUT_DIR}
OUT=${2:?usage: speed.sh MODEL_DIR OUT_DIR}
THREADS_LIST=${THREADS_LIST:-"1 2"}
CONTEXTS=${CONTEXTS:-"128 512 1024 1984"}
REPEATS=${REPEATS:-3}
DECODE_TOKENS=${DECODE_TOKENS:-32}
ROUNDS=${ROUNDS:-3}
KVSLIM=${KVSLIM:-build/bin/kvslim}
if [[ -z "${LLAMACPP_BIN:-}" ]]; then LLAMACPP_BIN="$(bench/llamacpp/build_llamacpp.sh)/bin"; fi
mkdir -p "$OUT"
GGUF=$(mktemp -d)/model-f16.gguf
trap 'rm -rf "$(dirname "$GGUF")"' EXIT
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

"$KVSLIM" convert "$MODEL" "$GGUF" --type f16 >&2
ctx_list=$(echo $CONTEXTS | tr ' ' ',')
# ROUNDS rounds, each running both engines at every thread count: the machine's state drifts over
# minutes, so each figure is the best over rounds (llama.cpp: best repetition; kvslim: best of its
# repeats), both engines judged by the same statistic.
for round in $(seq 1 "$ROUNDS"); do
  for t in $THREADS_LIST; do
    log "round $round: llama-bench $t threads"
    "$LLAMACPP_BIN/llama-bench" -m "$GGUF" -t "$t" -fa 1 -r "$REPEATS" -p "$ctx_list" -n 0 -o json \
      > "$OUT/llama_pp_t${t}_r$round.json"
    for kv in f16 q8_0 q4_0; do
      "$LLAMACPP_BIN/llama-bench" -m "$GGUF" -t "$t" -fa 1 -ctk $kv -ctv $kv -r "$REPEATS" -p 0 -n "$DECODE_TOKENS" \
        -d "$ctx_list" -o json > "$OUT/llama_tg_${kv}_t${t}_r$round.json"
    done
    for blas in pinned unset; do
      log "round $round: kvslim bench engine $t threads, OpenBLAS $blas"
      unset_args=()
      [[ $blas == unset ]] && unset_args=(-u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)
      env "${unset_args[@]}" OPENBLAS_NUM_THREADS=$t "$KVSLIM" bench engine --model "$GGUF" --threads "$t" \
        --repeats "$REPEATS" --decode-tokens "$DECODE_TOKENS" --context $CONTEXTS --shared-prefill \
        --method full kivi kivi@kivi_bits=4 zipcache --json "$OUT/kvslim_${blas}_t${t}_r$round.json" \
        > "$OUT/kvslim_${blas}_t${t}_r$round.txt"
    done
  done
done

python3 - "$OUT" "$THREADS_LIST" "$ROUNDS" > "$OUT/summary.md" <<'PY'
import json, sys
out, threads, rounds = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
def llama(name, t):  # (n_prompt, n_depth) -> best tokens/s over rounds and repetitions
    best = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/llama_{name}_t{t}_r{r}.json")):
            key = (row["n_prompt"], row["n_depth"])
            best[key] = max(best.get(key, 0.0), max(row["samples_ts"]))
    return best
def kvslim(blas, t):  # (method, context) -> best (prefill, decode) over rounds
    best = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/kvslim_{blas}_t{t}_r{r}.json"))["runs"]:
            key = (row["method"], row["context"])
            p, d = best.get(key, (0.0, 0.0))
            best[key] = (max(p, row["prefill_tokens_per_s"]), max(d, row["decode_tokens_per_s"]))
    return best
print(f"Best of {rounds} rounds. Prefill ratios: kvslim with this machine's OpenBLAS pin / with OpenBLAS's own kernels.\n")
print("| threads | context | llama.cpp prefill | kvslim prefill (pinned / unset) | ratio | llama.cpp decode f16 / q8_0 / q4_0 "
      "| kvslim decode full | ratio | kvslim kivi2 / kivi4 / zipcache 4/2 decode (x own full) |")
print("|---|---|---|---|---|---|---|---|---|")
for t in threads:
    pp, f16, q8, q4 = llama("pp", t), llama("tg_f16", t), llama("tg_q8_0", t), llama("tg_q4_0", t)
    pin, uns = kvslim("pinned", t), kvslim("unset", t)
    for ctx in sorted({c for (_, c) in pin}):
        lp, ld = pp[(ctx, 0)], f16[(0, ctx)]
        kp, ku, kd = pin[("full", ctx)][0], uns[("full", ctx)][0], pin[("full", ctx)][1]
        comp = " / ".join("%.0f (%.2fx)" % (pin[(m, ctx)][1], pin[(m, ctx)][1] / kd)
                          for m in ("kivi", "kivi@kivi_bits=4", "zipcache"))
        print(f"| {t} | {ctx} | {lp:.0f} | {kp:.0f} / {ku:.0f} | {kp / lp:.2f} / {ku / lp:.2f} | "
              f"{ld:.0f} / {q8[(0, ctx)]:.0f} / {q4[(0, ctx)]:.0f} | {kd:.0f} | {kd / ld:.2f} | {comp} |")
PY
cat "$OUT/summary.md"
