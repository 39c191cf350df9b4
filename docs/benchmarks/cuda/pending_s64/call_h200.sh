#!/usr/bin/env bash
# Stop 64's second call (devbin as for call.sh: main's CLI and the TMA builds). #24's targets name the
# H200 and no H200 has come since stop 60, so on an H200 it measures what those targets need, most
# telling first: main against SDPA at the target shapes (the time-based warm-up, full included), the
# TMA A/B (kivi4 and zipcache wait on their copies there), then Nsight Compute's summaries and
# per-line stalls of kivi2 against K4V2 (pending_s61's profile). On an H100 (where call.sh ran) it
# asks Nsight Compute only why the TMA form is slower for kivi2: main's and the TMA build's summaries.
set -u
source bench/cuda/device_prelude.sh  # OUT, the library path, gpu.txt, devbin unpacked
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats"
NCU_ARGS="bench attend --device cuda --context 32768 --head-dim 128 --repeats 1 --batch 8"
if ! grep -q H200 "$OUT"/gpu.txt; then
  for name in kvslim kvslim_tma; do
    { echo "=== $name kivi2_g128"; timeout 60 ncu $NCU_SECTIONS -k regex:attend_codes -c 1 devbin/$name $NCU_ARGS --cache kivi2_g128; } \
      >> "$OUT"/ncu_tma_kivi2.txt 2>&1
  done
  grep -E "^===|Warp Cycles Per Issued|Issued Warp|Eligible Warps|No Eligible|Executed Ipc A|Duration|Registers Per|Achieved Occ|Stall" "$OUT"/ncu_tma_kivi2.txt | head -60
  exit 0
fi
timeout 100 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json "$OUT"/attend.json > "$OUT"/attend.txt 2>&1
timeout 100 python3 bench/cuda/sdpa_bench.py --kvslim "$OUT"/attend.json --json "$OUT"/sdpa.json 2>&1 | grep -v "^append" > "$OUT"/compare.txt
cat "$OUT"/compare.txt
ARGS="bench attend --device cuda --batch 8 1 --context 32768 --head-dim 128 --cache kivi2_g128 kivi4_g128 kivi_k4v2_g128 zipcache"
for name in kvslim kvslim_tma kvslim_tma3 kvslim; do
  { echo "=== $name"; timeout 60 devbin/$name $ARGS 2>&1 | grep -E "^ *128 |rror|what"; } >> "$OUT"/tma_ab.txt
done
cat "$OUT"/tma_ab.txt
for c in kivi2_g128 kivi_k4v2_g128; do
  { echo "=== $c"; timeout 60 ncu $NCU_SECTIONS -k regex:attend_codes -c 1 devbin/kvslim $NCU_ARGS --cache $c; } >> "$OUT"/ncu_summary.txt 2>&1
  timeout 90 ncu --section SourceCounters --section WarpStateStats -k regex:attend_codes -c 1 --page source --print-source sass \
    --csv devbin/kvslim $NCU_ARGS --cache $c > /tmp/$c.csv 2>&1
  xz -6 -c /tmp/$c.csv > "$OUT"/ncu_sass_$c.csv.xz
  python3 bench/cuda/ncu_stalls.py /tmp/$c.csv > "$OUT"/ncu_stalls_$c.txt 2>&1
done
python3 bench/cuda/ncu_stalls.py /tmp/kivi2_g128.csv /tmp/kivi_k4v2_g128.csv --per kivi2_g128=65536 --per kivi_k4v2_g128=65536 \
  > "$OUT"/ncu_stalls_kivi2_vs_k4v2.txt 2>&1
head -40 "$OUT"/ncu_stalls_kivi2_vs_k4v2.txt
