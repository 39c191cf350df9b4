#!/usr/bin/env bash
# A kvslim that runs on the GPU machine of /work/.library/device (no Debian packages there): the
# Release build's objects linked with OpenBLAS, PCRE2 and utf8proc statically, libstdc++/libgcc
# statically, Highway's small runtime library beside it. Writes devbin/kvslim.xz and
# devbin/libhwy.so.1 (devbin/ is git-ignored); carry devbin to the device and run
# bench/device/engine_r16.sh there.
#
#   bench/device/static_kvslim.sh [BUILD_DIR]   (default build; `make build` first)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
LIB=/usr/lib/x86_64-linux-gnu
mkdir -p devbin
g++ -O2 -o devbin/kvslim "$BUILD"/src/cli/CMakeFiles/kvslim_cli.dir/*.o \
  "$BUILD"/lib/libkvslim.a "$BUILD"/lib/libkvslim_engine.a "$BUILD"/lib/libkvslim.a \
  "$LIB"/libhwy.so.1 "$LIB"/openblas-pthread/libopenblas.a "$LIB"/libpcre2-8.a "$LIB"/libutf8proc.a \
  -Wl,-Bstatic -lgfortran -lquadmath -Wl,-Bdynamic -static-libstdc++ -static-libgcc -lpthread \
  -Wl,-rpath,'$ORIGIN'
cp -L "$LIB"/libhwy.so.1 devbin/libhwy.so.1
rm -f devbin/kvslim.xz
xz -T2 -6 devbin/kvslim
ls -la devbin/kvslim.xz devbin/libhwy.so.1
