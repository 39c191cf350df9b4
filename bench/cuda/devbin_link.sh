# Sourced by build_devbin.sh and build_variant.sh: the kvslim CLI as the GPU machine runs it (no
# Debian packages there), linked with OpenBLAS, PCRE2, utf8proc, libstdc++ and the CUDA runtime
# statically, Highway's small runtime library beside it.
#   link_kvslim_cli OUT BUILD_DIR LIBKVSLIM
DEVBIN_SYSLIB=/usr/lib/x86_64-linux-gnu
DEVBIN_CUDA_LIB=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/../lib
[ -f "$DEVBIN_CUDA_LIB/libcudart_static.a" ] || DEVBIN_CUDA_LIB=/usr/local/cuda/lib64
link_kvslim_cli() {
  local out=$1 build=$2 libkvslim=$3 lib=$DEVBIN_SYSLIB
  g++ -O2 -o "$out" "$build"/src/cli/CMakeFiles/kvslim_cli.dir/*.o \
    "$libkvslim" "$build"/lib/libkvslim_engine.a "$libkvslim" \
    "$lib"/libhwy.so.1 "$lib"/openblas-pthread/libopenblas.a "$lib"/libpcre2-8.a "$lib"/libutf8proc.a \
    "$DEVBIN_CUDA_LIB"/libcudart_static.a -ldl -lrt \
    -Wl,-Bstatic -lgfortran -lquadmath -Wl,-Bdynamic -static-libstdc++ -static-libgcc -lpthread \
    -Wl,-rpath,'$ORIGIN'
}
