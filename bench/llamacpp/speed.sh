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
# Environment: THREADS_LIST ("1 2"), CONTEXTS ("128 512 1024 1984"), REPEATS (3), DECODE_TOKENS (32),
# KVSLIM (build/bin/kvslim), LLAMACPP_BIN (default: bench/llamacpp/build_llamacpp.sh's build).
# Output: OUT_DIR/llama_*.md, kvslim_*.txt / .json and summary.md (the table with ratios).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?usage: speed.sh MODEL_DIR OUT_DIR}
OUT=${2:?usage: speed.sh MODEL_DIR OUT_DIR}
THREADS_LIST=${THREADS_LIST:-"1 2"}
CONTEXTS=${CONTEXTS:-"128 512 1024 1984"}
REPEATS=${REPEATS:-3}
DECODE_TOKENS=${DECODE_TOKENS:-32}
KVSLIM=${KVSLIM:-build/bin/kvslim}
if [[ -z "${LLAMACPP_BIN:-}" ]]; then LLAMACPP_BIN="$(bench/llamacpp/build_llamacpp.sh)/bin"; fi
mkdir -p "$OUT"
GGUF=$(mktemp -d)/model-f16.gguf
trap 'rm -rf "$(dirname "$GGUF")"' EXIT
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

"$KVSLIM" convert "$MODEL" "$GGUF" --type f16 >&2
ctx_list=$(echo $CONTEXTS | tr ' ' ',')
for t in $THREADS_LIST; do
  log "llama-bench $t threads"
  "$LLAMACPP_BIN/llama-bench" -m "$GGUF" -t "$t" -fa 1 -r "$REPEATS" -p "$ctx_list" -n 0 > "$OUT/llama_pp_t$t.md"
  "$LLAMACPP_BIN/llama-bench" -m "$GGUF" -t "$t" -fa 1 -r "$REPEATS" -p 0 -n "$DECODE_TOKENS" -d "$ctx_list" \
    > "$OUT/llama_tg_t$t.md"
  for kv in q8_0 q4_0; do
    "$LLAMACPP_BIN/llama-bench" -m "$GGUF" -t "$t" -fa 1 -ctk $kv -ctv $kv -r "$REPEATS" -p 0 -n "$DECODE_TOKENS" \
      -d "$ctx_list" > "$OUT/llama_tg_${kv}_t$t.md"
  done
  for blas in pinned unset; do
    log "kvslim bench engine $t threads, OpenBLAS $blas"
    unset_args=()
    [[ $blas == unset ]] && unset_args=(-u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)
    env "${unset_args[@]}" OPENBLAS_NUM_THREADS=$t "$KVSLIM" bench engine --model "$GGUF" --threads "$t" \
      --repeats "$REPEATS" --decode-tokens "$DECODE_TOKENS" --context $CONTEXTS --shared-prefill \
      --method full kivi kivi@kivi_bits=4 zipcache --json "$OUT/kvslim_${blas}_t$t.json" > "$OUT/kvslim_${blas}_t$t.txt"
  done
done

python3 - "$OUT" "$THREADS_LIST" > "$OUT/summary.md" <<'PY'
import json, re, sys
out, threads = sys.argv[1], sys.argv[2].split()
def llama(path):  # test name -> tokens/s
    rows = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 8 and re.match(r'(pp|tg)\d', cells[-2]):
            rows[cells[-2]] = float(cells[-1].split()[0])
    return rows
print("| threads | context | llama.cpp prefill | kvslim prefill (pinned / unset) | ratio | llama.cpp decode f16 / q8_0 / q4_0 "
      "| kvslim decode full | ratio | kvslim kivi2 / kivi4 / zipcache 4/2 decode (x own full) |")
print("|---|---|---|---|---|---|---|---|---|")
for t in threads:
    pp, tg = llama(f"{out}/llama_pp_t{t}.md"), llama(f"{out}/llama_tg_t{t}.md")
    q8, q4 = llama(f"{out}/llama_tg_q8_0_t{t}.md"), llama(f"{out}/llama_tg_q4_0_t{t}.md")
    runs = {b: json.load(open(f"{out}/kvslim_{b}_t{t}.json"))["runs"] for b in ("pinned", "unset")}
    for ctx in sorted({r["context"] for r in runs["pinned"]}):
        at = lambda b, m: next(r for r in runs[b] if r["context"] == ctx and r["method"] == m)
        full = at("pinned", "full")
        lp = pp[f"pp{ctx}"]
        dec = [k for k in tg if k.endswith(f"@ d{ctx}")][0]
        ld = tg[dec]
        comp = " / ".join("%.0f (%.2fx)" % (at("pinned", m)["decode_tokens_per_s"], at("pinned", m)["decode_tokens_per_s"] / full["decode_tokens_per_s"])
                          for m in ("kivi", "kivi@kivi_bits=4", "zipcache"))
        print(f"| {t} | {ctx} | {lp:.0f} | {full['prefill_tokens_per_s']:.0f} / {at('unset', 'full')['prefill_tokens_per_s']:.0f} | "
              f"{full['prefill_tokens_per_s'] / lp:.2f} / {at('unset', 'full')['prefill_tokens_per_s'] / lp:.2f} | "
              f"{ld:.0f} / {q8[dec]:.0f} / {q4[dec]:.0f} | {full['decode_tokens_per_s']:.0f} | {full['decode_tokens_per_s'] / ld:.2f} | {comp} |")
PY
cat "$OUT/summary.md"
