#!/usr/bin/env bash
# Issue 27's retrieval protocol on the GPU machine's 16 CPU cores (the `device` tool, devbin
# carried after bench/device/static_kvslim.sh): models/tiny, 1,536-token episodes, 40 per task
# (depths 0.1-0.9 x 8 trials), question inside the prompt and after the compressed context, three
# turns. Each group is one `kvslim eval` process; they run side by side and write their JSON (and
# FILE.partial as points finish) and the summary (.log) into $OUT: a call cut short keeps what finished.
#
#   bash bench/device/later_question.sh GROUP...     GROUP: before | quant | explore | after
set -u
(cd devbin && xz -dkf kvslim.xz && chmod +x kvslim)
K=devbin/kvslim
export OPENBLAS_CORETYPE=SkylakeX
LIMIT=${LIMIT:-560}
COMMON="--model models/tiny --tasks passkey,kvlist,multikey --lengths 1536 --depths 0.1,0.3,0.5,0.7,0.9 --trials 8
  --turns 3 --contexts 64 --windows 1 --continuation 4 --no-speed --no-progress"
run() {  # name threads args...
  local name=$1 threads=$2; shift 2
  timeout "$LIMIT" $K eval $COMMON --threads "$threads" --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 &
}
for g in "$@"; do
  case $g in
    before)  # the table: h2o / squeeze at 50-12.5 %, pyramidkv / streaming at 25 %
      run before_evict 6 --methods h2o,squeeze_s1 --levels 0.5,0.25,0.125
      run before_pyr_stream 2 --methods pyramidkv,streaming --levels 0.25 ;;
    quant)   # quantizers at their own bytes
      run quant 9 --methods kivi2,kivi4,zipcache_4_2_h20,kivi3_g32,kivi3_g64,kivi3_g128,kivi4_g128,kivi2_g128,zipcache_4_3_h20 ;;
    explore) # existing prefill-scoring knobs, question after the context only, at 25 %
      run explore 7 --settings later --methods h2o_nowindow,h2o_w64_p15,h2o_w256_p15,h2o_nocross,h2o_attn_norm,h2o_cross1 --levels 0.25 ;;
    *) echo "unknown group $g" >&2 ;;
  esac
done
wait
nproc > "$OUT/cpu.txt"; lscpu | grep -E "Model name" >> "$OUT/cpu.txt"
