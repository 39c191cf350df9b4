#!/usr/bin/env bash
# Binaries for the GPU machine (/work/.library's `device`: no Debian packages there), from a build
# with CUDA (`make build` where nvcc 12+ is installed): the CUDA test suite and a kvslim CLI linked
# with OpenBLAS, PCRE2, utf8proc, libstdc++ and the CUDA runtime statically, Highway's small runtime
# library beside them. Writes devbin/ (git-ignored); carry it and run bench/cuda/device_run.sh there.
#
#   bench/cuda/build_devbin.sh [BUILD_DIR]   (default build)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
LIB=/usr/lib/x86_64-linux-gnu
CUDA_LIB=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/../lib
[ -f "$CUDA_LIB/libcudart_static.a" ] || CUDA_LIB=/usr/local/cuda/lib64
mkdir -p devbin
g++ -O2 -o devbin/kvslim "$BUILD"/src/cli/CMakeFiles/kvslim_cli.dir/*.o \
  "$BUILD"/lib/libkvslim.a "$BUILD"/lib/libkvslim_engine.a "$BUILD"/lib/libkvslim.a \
  "$LIB"/libhwy.so.1 "$LIB"/openblas-pthread/libopenblas.a "$LIB"/libpcre2-8.a "$LIB"/libutf8proc.a \
  "$CUDA_LIB"/libcudart_static.a -ldl -lrt \
  -Wl,-Bstatic -lgfortran -lquadmath -Wl,-Bdynamic -static-libstdc++ -static-libgcc -lpthread \
  -Wl,-rpath,'$ORIGIN'
cp "$BUILD"/bin/cuda_tests devbin/cuda_tests
cp -L "$LIB"/libhwy.so.1 devbin/libhwy.so.1
# xz'd: the device takes the tree plus carried paths up to 64 MiB (device_run.sh unpacks them)
xz -T2 -6 -f devbin/kvslim devbin/cuda_tests
ls -la devbin
