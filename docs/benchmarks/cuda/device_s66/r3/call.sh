#!/usr/bin/env bash
# Stop 66's third call: main / pending_s66's form / main beside torch SDPA at batch 1 and 8 x 32k,
# then both at 1 x 128k (the #24 cases).
set -u
source bench/cuda/device_prelude.sh >/dev/null 2>&1
C="full kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
for name in kvslim kvslim_land kvslim; do
  { echo "=== $name"
    timeout 90 devbin/$name bench attend --device cuda --batch 1 8 --context 32768 --head-dim 128 --cache $C --json /tmp/ab_$name.json > /tmp/ab_$name.txt 2>&1 &&
    timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/ab_$name.json --json /tmp/ab_sdpa.json 2>&1 | grep -v "^append"; } >> "$OUT"/ab_compare.txt
done
for name in kvslim_land kvslim; do
  { echo "=== $name 1 x 128k"
    timeout 90 devbin/$name bench attend --device cuda --batch 1 --context 131072 --head-dim 128 --cache full kivi2_g128 kivi4_g128 --json /tmp/l_$name.json > /dev/null 2>&1 &&
    timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/l_$name.json --json /tmp/l_sdpa.json 2>&1 | grep -v "^append"; } >> "$OUT"/compare128k.txt
done
cat "$OUT"/ab_compare.txt "$OUT"/compare128k.txt | grep -v "^#"
