#!/usr/bin/env bash
# pending_s61's device call (written in stop 60, not yet run; ~150 s, most telling first, each result into $OUT):
# where kivi2's decode codes kernel waits on the H200, line by line, against K4V2's, which takes
# only 4 % longer while it reads 1.5x the codes (device_s60/r2). For each cache: Nsight Compute's
# summary sections of one codes-kernel launch at batch 8 x 32k (D 128), then its per-line SASS
# counters (xz'd CSV) and bench/cuda/ncu_stalls.py's reading of them; the two side by side per unit
# (64 sequences x heads x 1,024 units). Last, the attention bench at the H200's target shapes with
# torch SDPA beside it (main's figures, full included: #24's "within 10 %" at 1 x 32k).
# Carry ["devbin"] with devbin/kvslim.xz (main) and libhwy; models/tiny out of the tree.
set -u
OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
xz -dkf devbin/kvslim.xz && chmod +x devbin/kvslim
NCU_ARGS="devbin/kvslim bench attend --device cuda --context 32768 --head-dim 128 --repeats 1 --batch 8"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT"/ncu_summary.txt 2>&1
for c in kivi2_g128 kivi_k4v2_g128; do
  { echo "=== $c"
    timeout 60 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section InstructionStats -k regex:attend_codes -c 1 $NCU_ARGS --cache $c; } \
    >> "$OUT"/ncu_summary.txt 2>&1
  timeout 90 ncu --section SourceCounters --section WarpStateStats -k regex:attend_codes -c 1 --page source --print-source sass \
    --csv $NCU_ARGS --cache $c > /tmp/$c.csv 2>&1
  xz -6 -c /tmp/$c.csv > "$OUT"/ncu_sass_$c.csv.xz
  python3 bench/cuda/ncu_stalls.py /tmp/$c.csv > "$OUT"/ncu_stalls_$c.txt 2>&1
done
python3 bench/cuda/ncu_stalls.py /tmp/kivi2_g128.csv /tmp/kivi_k4v2_g128.csv --per kivi2_g128=65536 --per kivi_k4v2_g128=65536 \
  > "$OUT"/ncu_stalls_kivi2_vs_k4v2.txt 2>&1
timeout 90 devbin/kvslim bench attend --device cuda --batch 1 8 --context 32768 131072 --head-dim 128 \
  --cache full kivi4_g128 kivi2_g128 kivi_k4v2_g128 zipcache --json /tmp/attend.json > "$OUT"/attend.txt 2>&1
timeout 90 python3 bench/cuda/sdpa_bench.py --kvslim /tmp/attend.json --json /tmp/sdpa.json 2>&1 | grep -v "^append" > "$OUT"/compare.txt
head -40 "$OUT"/ncu_stalls_kivi2_vs_k4v2.txt; cat "$OUT"/compare.txt
