#!/usr/bin/env bash
# stop 61's sixth device call: the attention bench with the time-based warm-up (50 ms of GPU time
# before each timing, kvslim's and SDPA's alike), twice: full, kivi4, kivi2, K4V2 and zipcache at
# batch 1 / 8 x 32k / 128k against torch SDPA.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
xz -dkf devbin/kvslim.xz && chmod +x devbin/kvslim
for r in 1 2; do
  { echo "=== run $r"
    timeout 120 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
      --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json /tmp/w.json > "$OUT"/attend_$r.txt 2>&1 &&
    timeout 120 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/w.json --json "$OUT"/sdpa_$r.json 2>&1 | grep -v "^append"; } \
    >> "$OUT"/compare.txt 2>&1
  cp /tmp/w.json "$OUT"/attend_$r.json
done
cat "$OUT"/compare.txt
