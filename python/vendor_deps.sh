#!/usr/bin/env bash
# Copies the header-only / prebuilt pieces the Python build needs from this Debian 12 machine into
# python/third_party/ (ignored by git), for a machine that has a compiler and Python but no apt
# packages (the GPU machine): pybind11 headers (pybind11-dev) and Highway (libhwy-dev: headers and
# libhwy.so.1, which needs only glibc >= 2.14 and GLIBCXX_3.4.21). Bring that folder along (the
# device tool's `carry`), then python/build.sh picks it up where the machine lacks its own.
set -euo pipefail
cd "$(dirname "$0")"
dest=third_party
rm -rf "$dest" && mkdir -p "$dest/include" "$dest/lib"
for p in pybind11-dev libhwy-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || { echo "vendor_deps.sh: $p is not installed (apt-get install $p)"; exit 1; }
done
cp -r /usr/include/pybind11 /usr/include/hwy "$dest/include/"
lib=$(dpkg -L libhwy1 | grep '/libhwy\.so\.1$' | head -n 1)
cp -L "$lib" "$dest/lib/libhwy.so.1"
cp /usr/share/doc/pybind11-dev/copyright "$dest/pybind11.copyright"
cp /usr/share/doc/libhwy-dev/copyright "$dest/hwy.copyright"
echo "python/third_party: pybind11 $(dpkg-query -W -f='${Version}' pybind11-dev), highway $(dpkg-query -W -f='${Version}' libhwy-dev) ($(du -sh "$dest" | cut -f1))"
