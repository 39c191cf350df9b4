#!/usr/bin/env bash
# A kernel A/B variant for the GPU machine: one CUDA source of src/kvslim compiled again with extra
# flags (e.g. a -D that picks another form of a kernel), swapped into a copy of the build's
# libkvslim.a, and the kvslim CLI and the CUDA test suite linked from it as devbin/kvslim_NAME.xz
# and devbin/cuda_tests_NAME.xz (beside build_devbin.sh's devbin/kvslim.xz, which
# device_kernel_ab.sh benches first and last). Run build_devbin.sh first (it writes devbin/).
#
#   bench/cuda/build_variant.sh NAME SOURCE "FLAGS" [BUILD_DIR]
#   e.g. bench/cuda/build_variant.sh bare2 src/kvslim/cuda/attend_codes_half.cu "-DKVSLIM_HALF_BARE_FROM=2"
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
NAME=$1 SOURCE=$2 FLAGS=$3 BUILD=$(cd "${4:-build}" && pwd)
[ -f devbin/libhwy.so.1 ] || { echo "devbin/ is missing: run bench/cuda/build_devbin.sh first" >&2; exit 1; }
case "$NAME" in *[!a-z0-9_]*|"") echo "NAME must be [a-z0-9_]+: $NAME" >&2; exit 1;; esac
source bench/cuda/devbin_link.sh
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# The object as cmake compiles it (its defines, includes and flags), plus FLAGS.
FLAGS_MAKE="$BUILD"/src/kvslim/CMakeFiles/kvslim.dir/flags.make
get() { sed -n "s/^$1 = //p" "$FLAGS_MAKE"; }
MEMBER=$(basename "$SOURCE").o
(cd "$BUILD"/src/kvslim && nvcc -forward-unknown-to-host-compiler $(get CUDA_DEFINES) $(get CUDA_INCLUDES) $(get CUDA_FLAGS) \
  $FLAGS -x cu -c "$ROOT/$SOURCE" -o "$TMP/$MEMBER")
cp "$BUILD"/lib/libkvslim.a "$TMP"/libkvslim.a
ar t "$TMP"/libkvslim.a | grep -qx "$MEMBER" || { echo "$MEMBER is not a member of libkvslim.a" >&2; exit 1; }
ar r "$TMP"/libkvslim.a "$TMP/$MEMBER"
link_kvslim_cli devbin/kvslim_"$NAME" "$BUILD" "$TMP"/libkvslim.a
# The test suite as cmake links it (its link line), with the variant's library.
LINK=$(sed "s# -o ../bin/cuda_tests # -o $ROOT/devbin/cuda_tests_$NAME #; s#\.\./lib/libkvslim\.a#$TMP/libkvslim.a#g" \
  "$BUILD"/tests/CMakeFiles/cuda_tests.dir/link.txt)
(cd "$BUILD"/tests && eval "$LINK")
xz -T2 -6 -f devbin/kvslim_"$NAME" devbin/cuda_tests_"$NAME"
ls -la devbin/kvslim_"$NAME".xz devbin/cuda_tests_"$NAME".xz
