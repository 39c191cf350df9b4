#!/usr/bin/env bash
# Builds the kvslim Python package from this repository with what the machine has.
#   python/build.sh              -> $BUILD/python/kvslim (use with PYTHONPATH=$BUILD/python)
#   python/build.sh --install    -> also copies the package into the interpreter's site-packages
# Env: PYTHON (python3), BUILD (build-python), JOBS (nproc), CXX (c++),
#      KVSLIM_STATIC_RUNTIME=OFF (take libstdc++ dynamically; by default the module carries its own,
#      since pip's torch exports libstdc++ symbols that a dynamic module would bind to: python/CMakeLists.txt).
# Needs a C++20 compiler and the interpreter's headers (Python.h). pybind11 and Highway come from
# the system, from pip's pybind11 module, or from python/third_party (python/vendor_deps.sh).
# With CMake >= 3.25 the build goes through CMake (-DKVSLIM_BUILD_PYTHON=ON); without it, the
# library and the module are compiled directly here (same sources, same flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build-python}
JOBS=${JOBS:-$(nproc)}
install=0
[ "${1:-}" = "--install" ] && install=1

py() { "$PYTHON" -c "$1"; }
PYDIR="$BUILD/python/kvslim"
third=python/third_party

cmake_bin=$(command -v cmake || true)
if [ -z "$cmake_bin" ]; then  # pip's cmake package
  cmake_bin=$(py "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'cmake'))" 2>/dev/null || true)
fi
cmake_ok=0
[ -n "${KVSLIM_NO_CMAKE:-}" ] && cmake_bin=""  # force the direct build (tests the fallback)
if [ -n "$cmake_bin" ] && [ -x "$cmake_bin" ]; then
  ver=$("$cmake_bin" --version | head -n 1 | grep -o '[0-9][0-9.]*' | head -n 1)
  if [ "$(printf '%s\n3.25\n' "$ver" | sort -V | head -n 1)" = "3.25" ]; then cmake_ok=1; fi
fi

if [ "$cmake_ok" = 1 ]; then
  echo "build.sh: CMake $ver"
  "$cmake_bin" -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVSLIM_BUILD_PYTHON=ON -DKVSLIM_BUILD_ENGINE=OFF \
    -DKVSLIM_BUILD_TESTS=OFF -DKVSLIM_BUILD_BENCH=OFF -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
    -DKVSLIM_PYTHON_STATIC_RUNTIME="${KVSLIM_STATIC_RUNTIME:-ON}" >/dev/null
  "$cmake_bin" --build "$BUILD" -j "$JOBS" --target kvslim_python
else
  echo "build.sh: no CMake >= 3.25; compiling directly with ${CXX:-c++}"
  CXX=${CXX:-c++}
  inc=$(py "import sysconfig; print(sysconfig.get_paths()['include'])")
  [ -f "$inc/Python.h" ] || { echo "build.sh: $inc/Python.h missing (install the python3-dev package)"; exit 1; }
  suffix=$(py "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  flags=(-std=c++20 -O2 -DNDEBUG -fPIC -fvisibility=hidden -Iinclude -Isrc/kvslim -isystem "$inc")
  # Its own C++ runtime and pybind11 internals (see python/CMakeLists.txt: torch exports libstdc++ symbols).
  runtime=()
  if [ "${KVSLIM_STATIC_RUNTIME:-ON}" = ON ]; then
    flags+=('-DPYBIND11_COMPILER_TYPE="_kvslim"'); runtime=(-static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL)
  fi
  case "$(uname -m)" in x86_64) flags+=(-march=x86-64-v2) ;; esac
  pyb=$(py "import pybind11; print(pybind11.get_include())" 2>/dev/null || true)
  if [ -n "${KVSLIM_VENDORED:-}" ]; then pyb=""; fi  # force python/third_party (tests the fallback)
  if [ -n "$pyb" ]; then flags+=(-isystem "$pyb")
  elif [ -f /usr/include/pybind11/pybind11.h ] && [ -z "${KVSLIM_VENDORED:-}" ]; then :
  elif [ -f "$third/include/pybind11/pybind11.h" ]; then flags+=(-isystem "$third/include")
  else echo "build.sh: pybind11 not found (pip install pybind11, apt-get install pybind11-dev, or python/vendor_deps.sh)"; exit 1; fi
  hwy_lib=()
  if [ -z "${KVSLIM_VENDORED:-}" ] && [ -f /usr/include/hwy/highway.h ] && ls /usr/lib/*/libhwy.so /usr/lib/libhwy.so >/dev/null 2>&1; then hwy_lib=(-lhwy)
  elif [ -f "$third/include/hwy/highway.h" ] && [ -f "$third/lib/libhwy.so.1" ]; then
    flags+=(-isystem "$third/include"); hwy_lib=("$PWD/$third/lib/libhwy.so.1" -Wl,-rpath,'$ORIGIN')
  else echo "build.sh: Highway not found (apt-get install libhwy-dev, or python/vendor_deps.sh)"; exit 1; fi
  obj="$BUILD/obj"
  mkdir -p "$obj" "$PYDIR"
  srcs=$(find src/kvslim python/src -name '*.cc' | sort)
  # Compile in parallel, one object per source (path flattened into the object name).
  printf '%s\n' $srcs | xargs -P "$JOBS" -I{} bash -c 'o="$1/$(echo "$2" | tr / _).o"; [ "$o" -nt "$2" ] || { echo "  $2"; $3 "${@:4}" -c "$2" -o "$o"; }' \
    bash "$obj" {} "$CXX" "${flags[@]}"
  $CXX -shared -o "$PYDIR/_kvslim$suffix" "$obj"/*.o "${hwy_lib[@]}" "${runtime[@]}" -lpthread
  [ -f "$third/lib/libhwy.so.1" ] && [ "${hwy_lib[0]}" != "-lhwy" ] && cp "$third/lib/libhwy.so.1" "$PYDIR/"
fi
mkdir -p "$PYDIR"
cp python/kvslim/*.py "$PYDIR/"
PYTHONPATH="$BUILD/python" "$PYTHON" -c "import kvslim; print('build.sh: kvslim', kvslim.__version__, 'built in $BUILD/python, SIMD', kvslim.simd_target())"

if [ "$install" = 1 ]; then
  site=$(py "import sysconfig; print(sysconfig.get_path('platlib'))")
  rm -rf "$site/kvslim" && cp -r "$PYDIR" "$site/kvslim"
  (cd / && "$PYTHON" -c "import kvslim; print('build.sh: installed', kvslim.__file__)")
fi
