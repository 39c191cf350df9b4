#!/usr/bin/env bash
# On the GPU machine: the attention bench of several builds of the kvslim CLI in one call, for
# kernel A/B runs (devbin/kvslim_<name>.xz beside devbin/kvslim.xz, each linked from one build with
# one kernel source compiled another way, or all of them in devbin/bins.tar.xz: pack_devbin.sh).
# For each: `kvslim bench attend --device cuda` at batch 1 and 8 x 32k (D 128) and torch SDPA at
# the same shapes (bench/cuda/sdpa_bench.py), appended to $OUT/ab_compare.txt as it finishes; the
# shipped binary runs first and last, so that the drift of the machine between runs shows.
#   [CACHES="kivi2_g128 ..."] bash bench/cuda/device_kernel_ab.sh
set -u
source bench/cuda/device_prelude.sh  # OUT, the library path, gpu.txt, devbin unpacked
ARGS="--batch 1 8 --context 32768 --head-dim 128"
[ -n "${CACHES:-}" ] && ARGS="$ARGS --cache $CACHES"
names=(kvslim)
for f in devbin/kvslim_*; do [[ "$f" == *.xz ]] || names+=("$(basename "$f")"); done
names+=(kvslim)
for name in "${names[@]}"; do
  { echo "=== $name"
    timeout 90 devbin/$name bench attend --device cuda $ARGS --json /tmp/ab_$name.json > /tmp/ab_$name.txt 2>&1 &&
    timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/ab_$name.json --json /tmp/ab_sdpa.json 2>&1 | grep -v "^append"; } \
    >> "$OUT"/ab_compare.txt
done
cat "$OUT"/ab_compare.txt
