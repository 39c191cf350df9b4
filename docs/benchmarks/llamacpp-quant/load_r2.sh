#!/usr/bin/env bash
# llama.cpp's 2-thread decode with one competing CPU-bound process on the 2-core machine.
set -u
B=/tmp/wt28_llamacpp/llama.cpp/build/bin; M=/tmp/wt28_bench/random-1b-q4_0.gguf; K=/tmp/wt28b_kvslim
echo "quiet:"; $B/llama-bench -m $M -t 2 -fa 1 -p 0 -n 32 -r 2 -o md 2>/dev/null | grep tg32
( exec sh -c 'while :; do :; done' ) & HOG=$!
sleep 1; echo "with one busy-loop process (pid $HOG), load $(cut -d' ' -f1 /proc/loadavg):"
for opt in "" "--poll 0" "--cpu-strict 1" "-t 1"; do
  echo "llama-bench $opt:"; $B/llama-bench -m $M -t 2 -fa 1 -p 0 -n 32 -r 2 $opt -o md 2>/dev/null | grep tg32
done
echo "kvslim 2 threads:"; $K bench engine --model $M --threads 2 --repeats 2 --decode-tokens 32 --context 16 --method full | tail -1
kill $HOG
