#!/bin/bash
# Interleaved best-of rounds, Q4_0 / Q4_K_M on the 852 M random Llama: llama-bench decode at depth 0
# and 512 against kvslim's decode after 16 and 512 prompt tokens. The record of the runs in
# docs/gguf.md (depth_*.log here); paths as they were (LB: llama.cpp's bin, M: the converted files
# m852-TYPE.gguf, K: kvslim), each overridable.
LB=${LB:-/tmp/wt28_llamacpp/llama.cpp/build/bin}
M=${M:-/tmp/wt28_bench}
K=${K:-/work/wt-issue28/build/bin/kvslim}
for round in ${ROUNDS_LIST:-1 2 3}; do
for t in 1 2; do
for f in ${FILES:-q4_0 q4_k_m}; do
  echo "=== round $round threads $t $f $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  $LB/llama-bench -m $M/m852-$f.gguf -t $t -fa 1 -p 0 -n 32 -d 0,512 -r 2 2>&1 | grep -E "tg32"
  $K bench engine --model $M/m852-$f.gguf --context 16 512 --method full --decode-tokens 32 --repeats 2 --threads $t 2>&1 | grep -E "^full"
done
done
done
