#!/usr/bin/env bash
# Fallback for a machine too loaded to finish build_llamacpp.sh: once that build has produced ggml
# (libggml-base, libggml-cpu with its OpenMP thread pool and AVX-512 kernels, libggml -- the first
# ~15 % of it), compile only llama-bench and llama-perplexity from the same pinned source and link
# them to that ggml and to the npm package's prebuilt libllama / libllama-common (same commit,
# v0.4.0 of node-llama-cpp's build). Every compute kernel and the thread pool are the locally built
# ggml's; libllama only builds the graphs. Prints the directory holding the two tools.
#   bench/llamacpp/build_llamacpp_hybrid.sh [CACHE_DIR]
set -euo pipefail
CACHE="${1:-${KVSLIM_LLAMACPP_CACHE:-$HOME/.cache/kvslim-llamacpp}}"
cd "$CACHE"
L=llama.cpp; B=$L/build/bin; H=$PWD/hybrid
P=node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
for f in libggml-base.so.0 libggml-cpu.so.0 libggml.so.0; do
  [[ -e "$B/$f" ]] || { echo "no $B/$f yet: let build_llamacpp.sh build ggml first" >&2; exit 1; }
done
[[ -e "$P/libllama.v0.4.0.so" ]] || { echo "no prebuilt libllama in $P (npm i -E node-llama-cpp@3.21.1)" >&2; exit 1; }
mkdir -p "$H"
ln -sf "$CACHE/$P/libllama.v0.4.0.so" "$CACHE/$P/libllama-common.so" "$H/"
ln -sf "$CACHE/$B/libggml.so.0" "$H/libggml.so.0"; ln -sf "$CACHE/$B/libggml.so.0" "$H/libggml.v0.4.0.so"
ln -sf "$CACHE/$B/libggml-base.so.0" "$H/libggml-base.so.0"; ln -sf "$CACHE/$B/libggml-base.so.0" "$H/libggml-base.so"
ln -sf "$CACHE/$B/libggml-cpu.so.0" "$H/libggml-cpu.so.0"
I="-I$L/common -I$L/include -I$L/ggml/include -I$L/vendor"
LIBS="-L$H -l:libllama-common.so -l:libllama.v0.4.0.so -l:libggml.v0.4.0.so -l:libggml-base.so $L/build/common/libllama-common-base.a -Wl,-rpath,$H -pthread"
for t in llama-bench:llama-bench perplexity:llama-perplexity; do
  d=${t%%:*}; exe=${t##*:}
  [[ -x "$H/$exe" ]] || nice -n 10 g++ -O2 -DNDEBUG -std=c++17 $I $L/tools/$d/*.cpp -o "$H/$exe" $LIBS >&2
done
echo "$H"
