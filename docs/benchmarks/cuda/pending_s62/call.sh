#!/usr/bin/env bash
# pending_s62 (written in stop 62, not run): the decode codes kernel's arithmetic alone
# (-DKVSLIM_HALF_NO_LOOP_LOADS=1, each unit in its place) as it is; with the codes' conversions left
# out (values as paired words: no mask, no HMUL2; keys as packed words: no plane mask); and with more
# FMA-pipe work a unit (64 / 128 FFMA in 4 independent chains, 32 in one chain). Then main's
# attention bench against SDPA (full included). README.md says how to build the binaries.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT"/gpu.txt 2>&1; cat "$OUT"/gpu.txt
ARGS="bench attend --device cuda --batch 8 1 --context 32768 --head-dim 128 --cache kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
for name in kvslim_cmain kvslim_crawv kvslim_crawk kvslim_cpadf64 kvslim_cpadf128 kvslim_cpadc32 kvslim_cmain; do
  [ -x devbin/$name ] || { xz -dkf devbin/$name.xz && chmod +x devbin/$name; }
  { echo "=== $name"; timeout 60 devbin/$name $ARGS 2>&1 | grep -E "^ *128 |rror|what"; } >> "$OUT"/compute_only.txt
done
cat "$OUT"/compute_only.txt
xz -dkf devbin/kvslim.xz && chmod +x devbin/kvslim
timeout 100 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json "$OUT"/attend.json > "$OUT"/attend.txt 2>&1
timeout 100 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend.json --json "$OUT"/sdpa.json 2>&1 | grep -v "^append" > "$OUT"/compare.txt
cat "$OUT"/compare.txt
