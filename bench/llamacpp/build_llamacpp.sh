#!/usr/bin/env bash
# Builds the pinned llama.cpp (the source bundle inside npm's node-llama-cpp 3.21.1, commit 80fb11a)
# once, outside the repository, and prints the build directory.
#
#   bench/llamacpp/build_llamacpp.sh [CACHE_DIR]      (default: $KVSLIM_LLAMACPP_CACHE or ~/.cache/kvslim-llamacpp)
#
# Targets: llama-bench, llama-perplexity (the benchmark) and the shared libllama (the logits test helper).
# CPU only. No -march=native: the ISA is named explicitly (AVX2+FMA+F16C, plus AVX-512 F/VBMI/VNNI/BF16
# when this CPU has them), which is what llama.cpp's own default native build picks on this machine and
# what kvslim's Highway run-time dispatch uses, so both engines run the same instruction set.
# Takes about 13 CPU-minutes; it runs under `nice -n 10` since the machine is shared.
set -euo pipefail
CACHE="${1:-${KVSLIM_LLAMACPP_CACHE:-$HOME/.cache/kvslim-llamacpp}}"
PIN=3.21.1
mkdir -p "$CACHE"
cd "$CACHE"
BUILD="$CACHE/llama.cpp/build"
if [[ -x "$BUILD/bin/llama-bench" && -x "$BUILD/bin/llama-perplexity" ]]; then
  echo "$BUILD"; exit 0
fi
if [[ ! -f node_modules/node-llama-cpp/llama/gitRelease.bundle ]]; then
  [[ -f package.json ]] || echo '{"name":"kvslim-llamacpp-cache","private":true}' > package.json
  # --ignore-scripts: only the source bundle is needed, not the package's prebuilt binaries.
  npm i -E "node-llama-cpp@$PIN" --ignore-scripts >&2
fi
if [[ ! -d llama.cpp/.git ]]; then
  git clone -q node_modules/node-llama-cpp/llama/gitRelease.bundle llama.cpp >&2
fi
avx512=OFF
if grep -qw avx512f /proc/cpuinfo && grep -qw avx512vbmi /proc/cpuinfo && grep -qw avx512_vnni /proc/cpuinfo \
   && grep -qw avx512_bf16 /proc/cpuinfo; then avx512=ON; fi
cmake -S llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=$avx512 -DGGML_AVX512_VBMI=$avx512 -DGGML_AVX512_VNNI=$avx512 -DGGML_AVX512_BF16=$avx512 \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF >&2
nice -n 10 cmake --build "$BUILD" -j"${KVSLIM_LLAMACPP_JOBS:-2}" --target llama-bench llama-perplexity llama >&2
echo "$BUILD"
