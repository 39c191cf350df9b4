#!/usr/bin/env bash
# kvslim against llama.cpp on quantized GGUF weights (issue 28), in one run: each model converted
# once to Q8_0, Q4_0 and Q4_K_M (`kvslim convert --type`), the same file in both engines, at 1 and
# 2 threads, prefill and decode; kvslim's full cache and two compressed ones on top (kivi 2-bit,
# h2o at 25 % of the context); then the long-context decode (LONG tokens of context) of the
# compressed caches against llama.cpp's f16 KV on the same weights.
#
#   bench/llamacpp/quant.sh OUT_DIR MODEL...
# MODEL: a model directory (config.json + safetensors, as models/tiny), or `random-1b`: the issue's
# 852 M-parameter random Llama (16 layers, hidden 2048, 16/4 heads x 128, FFN 5632, vocab 32000),
# made once in CACHE by `kvslim random-model`.
# Environment: TYPES ("q8_0 q4_0 q4_k_m"), THREADS_LIST ("1 2"), CONTEXT (512), DECODE_TOKENS (32),
# ROUNDS (2), REPEATS (2), LONG (2048; capped at the model's max_position_embeddings - 64),
# LONG_TYPES ("q4_0"), LONG_THREADS ("2"), CACHE (~/.cache/kvslim-quant: converted files, reused),
# KVSLIM (build/bin/kvslim), LLAMACPP_BIN (default: bench/llamacpp/build_llamacpp.sh's build).
#
# Protocol (the issue's): llama-bench -fa 1 -p CONTEXT -n DECODE_TOKENS (decode from an empty
# context) against `kvslim bench engine --context CONTEXT --decode-tokens DECODE_TOKENS` (decode after
# the CONTEXT-token prompt: slightly more work for kvslim); the long phase decodes after LONG tokens
# in both (llama-bench -p 0 -n DECODE_TOKENS -d LONG, f16 KV). Rounds alternate the engines, and each
# figure is the best over rounds and repetitions for both (the machine is shared and its load moves).
# Output: OUT_DIR/raw/*.json and OUT_DIR/summary.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: quant.sh OUT_DIR MODEL...}
shift
[[ $# -ge 1 ]] || { echo "usage: quant.sh OUT_DIR MODEL..." >&2; exit 2; }
TYPES=${TYPES:-"q8_0 q4_0 q4_k_m"}
THREADS_LIST=${THREADS_LIST:-"1 2"}
CONTEXT=${CONTEXT:-512}
DECODE_TOKENS=${DECODE_TOKENS:-32}
ROUNDS=${ROUNDS:-2}
REPEATS=${REPEATS:-2}
LONG=${LONG:-2048}
LONG_TYPES=${LONG_TYPES:-"q4_0"}
LONG_THREADS=${LONG_THREADS:-"2"}
CACHE=${CACHE:-$HOME/.cache/kvslim-quant}
KVSLIM=${KVSLIM:-build/bin/kvslim}
if [[ -z "${LLAMACPP_BIN:-}" ]]; then LLAMACPP_BIN="$(bench/llamacpp/build_llamacpp.sh)/bin"; fi
mkdir -p "$OUT/raw" "$CACHE"
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# Models: name|source directory.
models=()
for m in "$@"; do
  if [[ $m == random-1b ]]; then
    dir=$CACHE/random-1b
    if [[ ! -f $dir/config.json ]]; then
      log "making the 852 M random Llama in $dir"
      "$KVSLIM" random-model --out "$dir" --dtype bf16 --hidden 2048 --intermediate 5632 --layers 16 --heads 16 \
        --kv-heads 4 --head-dim 128 --vocab 32000 --tokenizer >&2
    fi
    models+=("random-1b|$dir")
  else
    models+=("$(basename "$m")|$m")
  fi
done
for entry in "${models[@]}"; do
  name=${entry%%|*} dir=${entry#*|}
  for t in $TYPES; do
    f=$CACHE/$name-$t.gguf
    if [[ ! -f $f ]]; then
      log "convert $dir -> $f"
      "$KVSLIM" convert "$dir" "$f" --type "$t" >&2
    fi
  done
done

max_ctx() {  # the model's max_position_embeddings
  /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['max_position_embeddings'])" "$1/config.json"
}
methods() {  # full, kivi 2-bit, h2o at 25 % of context $1 (recent window: half the budget)
  local c=$1
  echo "full kivi@kivi_bits=2,kivi_group_size=32 h2o@h2o_budget=$((c / 4)),evict_recent_window=$((c / 8))"
}

for round in $(seq 1 "$ROUNDS"); do
  for entry in "${models[@]}"; do
    name=${entry%%|*} dir=${entry#*|}
    for t in $TYPES; do
      f=$CACHE/$name-$t.gguf
      for th in $THREADS_LIST; do
        tag=${name}_${t}_t${th}_r$round
        log "round $round: $name $t, $th threads (load $(cut -d' ' -f1-3 /proc/loadavg))"
        "$LLAMACPP_BIN/llama-bench" -m "$f" -t "$th" -fa 1 -p "$CONTEXT" -n "$DECODE_TOKENS" -r "$REPEATS" -o json \
          > "$OUT/raw/llama_$tag.json"
        # shellcheck disable=SC2046
        "$KVSLIM" bench engine --model "$f" --threads "$th" --repeats "$REPEATS" --decode-tokens "$DECODE_TOKENS" \
          --context "$CONTEXT" --shared-prefill --method $(methods "$CONTEXT") --json "$OUT/raw/kvslim_$tag.json" \
          > "$OUT/raw/kvslim_$tag.txt"
      done
    done
    # The long context: decode after LONG tokens (capped below the model's trained context).
    long=$LONG
    mc=$(max_ctx "$dir")
    if ((long + DECODE_TOKENS > mc)); then long=$((mc - 64)); fi
    for t in $LONG_TYPES; do
      f=$CACHE/$name-$t.gguf
      for th in $LONG_THREADS; do
        tag=${name}_${t}_t${th}_r$round
        log "round $round: $name $t, $th threads, decode after $long tokens (load $(cut -d' ' -f1-3 /proc/loadavg))"
        "$LLAMACPP_BIN/llama-bench" -m "$f" -t "$th" -fa 1 -ctk f16 -ctv f16 -p 0 -n "$DECODE_TOKENS" -d "$long" \
          -r "$REPEATS" -o json > "$OUT/raw/llama_long_$tag.json"
        # shellcheck disable=SC2046
        "$KVSLIM" bench engine --model "$f" --threads "$th" --repeats "$REPEATS" --decode-tokens "$DECODE_TOKENS" \
          --context "$long" --shared-prefill --method $(methods "$long") --json "$OUT/raw/kvslim_long_$tag.json" \
          > "$OUT/raw/kvslim_long_$tag.txt"
      done
    done
  done
done

/usr/bin/python3 - "$OUT" "$ROUNDS" "$TYPES" "$THREADS_LIST" "$LONG_TYPES" "$LONG_THREADS" "${models[@]}" \
  > "$OUT/summary.md" <<'PY'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
types, threads, long_types, long_threads = (a.split() for a in sys.argv[3:7])
names = [m.split("|")[0] for m in sys.argv[7:]]
raw = os.path.join(out, "raw")

def llama(prefix, tag):  # best (pp, tg) tokens/s over rounds and repetitions
    pp = tg = 0.0
    for r in range(1, rounds + 1):
        p = os.path.join(raw, f"{prefix}_{tag}_r{r}.json")
        if not os.path.exists(p):
            continue
        for row in json.load(open(p)):
            best = max(row["samples_ts"])
            if row["n_gen"] == 0:
                pp = max(pp, best)
            else:
                tg = max(tg, best)
    return pp, tg

def kvslim(prefix, tag):  # method -> best (prefill, decode) over rounds; and the context
    best, ctx = {}, None
    for r in range(1, rounds + 1):
        p = os.path.join(raw, f"{prefix}_{tag}_r{r}.json")
        if not os.path.exists(p):
            continue
        for row in json.load(open(p))["runs"]:
            m = row["method"].split("@")[0]
            if m == "kivi":
                m = "kivi2"
            elif m == "h2o":
                m = "h2o25"
            ctx = row["context"]
            a, b = best.get(m, (0.0, 0.0))
            best[m] = (max(a, row["prefill_tokens_per_s"]), max(b, row["decode_tokens_per_s"]))
    return best, ctx

def ratio(a, b):
    return f"**{a / b:.2f}**" if b and a / b >= 1 else (f"{a / b:.2f}" if b else "-")

print(f"Best of {rounds} rounds (and of each round's repetitions) for both engines; tokens/s.\n")
print("| model | weights | threads | llama.cpp prefill / decode | kvslim prefill / decode (full) | prefill ratio "
      "| decode ratio | kvslim decode kivi2 / h2o 25 % (x llama.cpp) |")
print("|---|---|---|---|---|---|---|---|")
def runs(llama_prefix, kvslim_prefix, types_, threads_):  # every measured (model, type, threads)
    for n in names:
        for t in types_:
            for th in threads_:
                tag = f"{n}_{t}_t{th}"
                pp, tg = llama(llama_prefix, tag)
                k, ctx = kvslim(kvslim_prefix, tag)
                if k:
                    yield n, t, th, pp, tg, k, ctx

for n, t, th, pp, tg, k, ctx in runs("llama", "kvslim", types, threads):
    fp, fd = k["full"]
    extra = " / ".join(f"{k[m][1]:.1f} ({k[m][1] / tg:.2f}x)" for m in ("kivi2", "h2o25") if m in k)
    print(f"| {n} | {t.upper()} | {th} | {pp:.1f} / {tg:.1f} | {fp:.1f} / {fd:.1f} | {ratio(fp, pp)} | "
          f"{ratio(fd, tg)} | {extra} |")
print("\nDecode after a long context: llama.cpp's f16 KV (flash attention) against kvslim's caches, same weights.\n")
print("| model | weights | threads | context | llama.cpp decode (f16 KV) | kvslim full | kivi2 | h2o 25 % |")
print("|---|---|---|---|---|---|---|---|")
for n, t, th, _, tg, k, ctx in runs("llama_long", "kvslim_long", long_types, long_threads):
    cells = [f"{k[m][1]:.1f} ({ratio(k[m][1], tg)}x)" for m in ("full", "kivi2", "h2o25")]
    print(f"| {n} | {t.upper()} | {th} | {ctx} | {tg:.1f} | " + " | ".join(cells) + " |")
PY
cat "$OUT/summary.md"
