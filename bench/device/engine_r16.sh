#!/usr/bin/env bash
# Run on the GPU machine's CPU (the `device` tool, with devbin carried; $OUT comes back): decode at
# 8k and 32k tokens on the random 16-layer model (8 KV heads of 128): one shared prefill on 16
# threads fills every method's cache, then each decodes alone on 2 threads. Every output is written
# into $OUT as it finishes, so a call cut short still brings back what it made.
#
#   bash bench/device/engine_r16.sh      (after bench/device/static_kvslim.sh here)
set -u
(cd devbin && xz -dkf kvslim.xz && chmod +x kvslim)
K=devbin/kvslim
export OPENBLAS_CORETYPE=SkylakeX  # OpenBLAS picks its SSE3 kernels on that virtual CPU otherwise
lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz" > "$OUT"/cpu.txt
grep -o -w -E "avx512vnni|avx512_vnni|avx512vbmi|avx512_vbmi" /proc/cpuinfo | sort -u >> "$OUT"/cpu.txt
$K random-model --force --out /tmp/r16 --hidden 1024 --intermediate 1024 --layers 16 --heads 32 --kv-heads 8 \
  --head-dim 128 --vocab 512 --max-positions 40000 > "$OUT"/model.txt 2>&1
M="full kivi kivi@kivi_bits=4 zipcache h2o"
timeout 150 $K bench engine --model /tmp/r16 --context 8192 --method $M --set h2o_budget=2048 --decode-tokens 32 \
  --repeats 1 --threads 2 --prefill-threads 16 --shared-prefill --json "$OUT"/engine8k.json > "$OUT"/engine8k.txt 2>&1
timeout 400 $K bench engine --model /tmp/r16 --context 32768 --method $M --set h2o_budget=8192 --decode-tokens 16 \
  --repeats 1 --threads 2 --prefill-threads 16 --shared-prefill --json "$OUT"/engine32k.json > "$OUT"/engine32k.txt 2>&1
