#!/usr/bin/env bash
# kvslim against llama.cpp on the same GGUF, threads and machine, in one run:
#   * speed: prefill and decode tokens/s at several contexts (llama-bench; `kvslim bench engine`),
#     F16 weights in both, llama.cpp's KV types f16 / q8_0 / q4_0 and kvslim's methods;
#   * fidelity: llama-perplexity's --kl-divergence protocol against an fp32 reference (llama.cpp
#     with F32 weights and an f32 KV cache) for llama.cpp's f16 / q8_0 / q4_0 KV and, with the same
#     reference file and tokens, kvslim's full cache, kivi 2/4, zipcache and eviction methods
#     (`kvslim bench kld`); each point with its resident KV bytes per token;
#   * report: table (Markdown), JSON and a PNG of KL vs KV bytes per token (bench/llamacpp/report.py).
#
#   bench/llamacpp/run.sh MODEL_DIR OUT_DIR
# Environment: THREADS (2: fidelity runs), SPEED_THREADS ("1 $THREADS"), CONTEXTS ("128 512 1024"), KL_CTX (512), KL_CHUNKS (8), REPEATS (3),
# DECODE_TOKENS (32), SKIP_SPEED (set: fidelity only), KVSLIM (build/bin/kvslim), LLAMACPP_BIN (a directory with llama-bench and
# llama-perplexity; default: build the pinned llama.cpp with bench/llamacpp/build_llamacpp.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:?usage: run.sh MODEL_DIR OUT_DIR}
OUT=${2:?usage: run.sh MODEL_DIR OUT_DIR}
THREADS=${THREADS:-2}
SPEED_THREADS=${SPEED_THREADS:-"1 $THREADS"}
CONTEXTS=${CONTEXTS:-"128 512 1024"}
KL_CTX=${KL_CTX:-512}
KL_CHUNKS=${KL_CHUNKS:-8}
REPEATS=${REPEATS:-3}
DECODE_TOKENS=${DECODE_TOKENS:-32}
KVSLIM=${KVSLIM:-build/bin/kvslim}
if [[ -z "${LLAMACPP_BIN:-}" ]]; then LLAMACPP_BIN="$(bench/llamacpp/build_llamacpp.sh)/bin"; fi
mkdir -p "$OUT/raw"
RAW="$OUT/raw"
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# ---- the same GGUF for both engines
"$KVSLIM" convert "$MODEL" "$RAW/model-f16.gguf" --type f16 >&2
"$KVSLIM" convert "$MODEL" "$RAW/model-f32.gguf" --type f32 >&2
TEXT="$MODEL/heldout_sample.txt"

# kvslim methods for speed and fidelity: label|method|options (budgets: half and a quarter of KL_CTX)
half=$((KL_CTX / 2)); quarter=$((KL_CTX / 4))
METHODS=(
  "full|full|"
  "kivi8-g256|kivi|kivi_bits=8 kivi_group_size=256 kivi_staging=256"
  "kivi4|kivi|kivi_bits=4 kivi_group_size=32"
  "kivi4-g128|kivi|kivi_bits=4 kivi_group_size=128 kivi_staging=128"
  "kivi3|kivi|kivi_bits=3 kivi_group_size=32"
  "kivi2|kivi|kivi_bits=2 kivi_group_size=32"
  "zipcache8/4|zipcache|zipcache_hi_bits=8 zipcache_lo_bits=4"
  "zipcache4/2|zipcache|zipcache_hi_bits=4 zipcache_lo_bits=2"
  "h2o-50%|h2o|h2o_budget=$half evict_recent_window=$((half / 2))"
  "h2o-25%|h2o|h2o_budget=$quarter evict_recent_window=$((quarter / 2))"
  "streaming-50%|streaming|streaming_budget=$half"
  "streaming-25%|streaming|streaming_budget=$quarter"
)
# ---- speed (F16 weights), at each thread count of SPEED_THREADS
ctx_list=$(echo $CONTEXTS | tr ' ' ',')
for t in $SPEED_THREADS; do
  [[ -n "${SKIP_SPEED:-}" ]] && break  # fidelity only (speed files of an earlier run stay in RAW)
  for kv in f16 q8_0 q4_0; do
    log "llama-bench $t threads, KV $kv"
    "$LLAMACPP_BIN/llama-bench" -m "$RAW/model-f16.gguf" -t "$t" -fa 1 -ctk $kv -ctv $kv -r "$REPEATS" \
      -p "$ctx_list" -n 0 -o json > "$RAW/llama_prefill_${kv}_t$t.json"
    "$LLAMACPP_BIN/llama-bench" -m "$RAW/model-f16.gguf" -t "$t" -fa 1 -ctk $kv -ctv $kv -r "$REPEATS" \
      -p 0 -n "$DECODE_TOKENS" -d "$ctx_list" -o json > "$RAW/llama_decode_${kv}_t$t.json"
  done
  log "llama-bench $t threads, KV f16 without flash attention"
  "$LLAMACPP_BIN/llama-bench" -m "$RAW/model-f16.gguf" -t "$t" -fa 0 -r "$REPEATS" -p "$ctx_list" -n 0 -o json > "$RAW/llama_prefill_f16_nofa_t$t.json"
  "$LLAMACPP_BIN/llama-bench" -m "$RAW/model-f16.gguf" -t "$t" -fa 0 -r "$REPEATS" -p 0 -n "$DECODE_TOKENS" -d "$ctx_list" -o json > "$RAW/llama_decode_f16_nofa_t$t.json"
  for entry in "${METHODS[@]}"; do
    IFS='|' read -r label method opts <<< "$entry"
    file=$(echo "$label" | tr '/%' '_p')
    log "kvslim bench engine $t threads, $label"
    OPENBLAS_NUM_THREADS=$t "$KVSLIM" bench engine --model "$RAW/model-f16.gguf" --threads "$t" --repeats "$REPEATS" \
      --decode-tokens "$DECODE_TOKENS" --context $CONTEXTS --method "$method" $(for o in $opts; do echo --set "$o"; done) \
      --json "$RAW/kvslim_speed_${file}_t$t.json" > /dev/null
  done
done

# ---- fidelity (F32 weights; fp32 reference = llama.cpp with an f32 KV cache)
log "llama-perplexity fp32 reference"
"$LLAMACPP_BIN/llama-perplexity" -m "$RAW/model-f32.gguf" -f "$TEXT" -c "$KL_CTX" --chunks "$KL_CHUNKS" -t "$THREADS" \
  -fa on -ctk f32 -ctv f32 --kl-divergence-base "$RAW/ref_llama_f32.kld" > "$RAW/llama_ppl_f32.txt" 2>&1
for kv in f16 q8_0 q4_0; do
  log "llama-perplexity KL, KV $kv"
  # llama.cpp logs from a background thread and can exit before the summary is written: retry.
  for attempt in 1 2 3; do
    "$LLAMACPP_BIN/llama-perplexity" -m "$RAW/model-f32.gguf" -c "$KL_CTX" -t "$THREADS" -fa on -ctk $kv -ctv $kv \
      --kl-divergence-base "$RAW/ref_llama_f32.kld" --kl-divergence > "$RAW/llama_kld_$kv.txt" 2>&1
    grep -q "Same top p" "$RAW/llama_kld_$kv.txt" && break
  done
done
log "kvslim bench kld full (also writes kvslim's own full-cache reference)"
"$KVSLIM" bench kld --model "$RAW/model-f32.gguf" --threads "$THREADS" --ref llama_f32="$RAW/ref_llama_f32.kld" \
  --method full --label full --write-base "$RAW/ref_kvslim_full.kld" --json "$RAW/kvslim_kld_full.json" >&2
for entry in "${METHODS[@]:1}"; do
  IFS='|' read -r label method opts <<< "$entry"
  file=$(echo "$label" | tr '/%' '_p')
  log "kvslim bench kld $label"
  "$KVSLIM" bench kld --model "$RAW/model-f32.gguf" --threads "$THREADS" --ref llama_f32="$RAW/ref_llama_f32.kld" \
    --ref kvslim_full="$RAW/ref_kvslim_full.kld" --method "$method" --label "$label" \
    $(for o in $opts; do echo --set "$o"; done) --json "$RAW/kvslim_kld_$file.json" >&2
done
rm -f "$RAW"/*.kld "$RAW"/*.gguf  # large and regenerable

python3 bench/llamacpp/report.py "$MODEL" "$RAW" "$OUT" "$SPEED_THREADS" "$KL_CTX"
