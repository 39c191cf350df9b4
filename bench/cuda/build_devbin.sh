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
source bench/cuda/devbin_link.sh
mkdir -p devbin
link_kvslim_cli devbin/kvslim "$BUILD" "$BUILD"/lib/libkvslim.a
cp "$BUILD"/bin/cuda_tests devbin/cuda_tests
cp -L "$DEVBIN_SYSLIB"/libhwy.so.1 devbin/libhwy.so.1
# xz'd: the device takes the tree plus carried paths up to 64 MiB (device_run.sh unpacks them)
xz -T2 -6 -f devbin/kvslim devbin/cuda_tests
ls -la devbin
