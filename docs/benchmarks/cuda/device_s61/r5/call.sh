#!/usr/bin/env bash
# stop 61's fifth device call: why kivi4 at batch 8 x 128k takes ~475 us eager against ~400 replayed
# (r4), where kivi2 and full differ by < 6 us. The bench with kivi4 alone, twice (20 and 60 repeats);
# then Nsight Compute's duration of every kernel of one eager call (kivi4 and kivi2, 8 x 128k).
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
xz -dkf devbin/kvslim.xz && chmod +x devbin/kvslim
B="devbin/kvslim bench attend --device cuda --batch 8 --context 131072 --head-dim 128"
{ for r in 20 60; do echo "=== kivi4 alone, repeats $r"; timeout 60 $B --cache kivi4_g128 --repeats $r 2>&1 | grep -v "^1 token\|^append\|^$"; done
  echo "=== kivi4 then kivi2 then kivi4, repeats 20"; timeout 60 $B --cache kivi4_g128 kivi2_g128 kivi4_g128 2>&1 | grep -v "^1 token\|^append\|^$"
} > "$OUT"/kivi4_eager.txt 2>&1
for c in kivi4_g128 kivi2_g128; do
  { echo "=== ncu, one eager call, $c"
    timeout 90 ncu --section SpeedOfLight --section LaunchStats --section Occupancy -k regex:"attend|combine" -c 4 $B --cache $c --repeats 1 2>&1 \
      | grep -E "^  [a-z_ ]*<|^  void|Duration|Grid Size|Block Size|Registers Per|Achieved Occupancy|Waves Per SM|Dynamic Shared" | head -80; } \
    >> "$OUT"/kivi4_eager.txt 2>&1
done
cat "$OUT"/kivi4_eager.txt
