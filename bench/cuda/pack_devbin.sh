#!/usr/bin/env bash
# devbin/'s binaries as one solid archive, devbin/bins.tar.xz, for the GPU machine's 64 MiB carry.
# The kernel A/B variants (build_variant.sh) differ from devbin/kvslim in one object of ~44 MB, so
# xz'd one by one each costs ~6 MB and the carry holds about eight; in one stream whose dictionary
# spans a whole binary, every binary after the first costs only its difference (stop 63: seven CLIs
# in 10 MB, against 42). Packs every devbin/*.xz, and what an earlier archive holds (a binary of the
# same name from a .xz replaces it), then removes the .xz files.
# On the GPU machine bench/cuda/device_prelude.sh unpacks it (device_run.sh and device_kernel_ab.sh
# source it).
#
#   bench/cuda/pack_devbin.sh          (about 20 s a binary on 2 cores)
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/../.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
names=()
if [ -f devbin/bins.tar.xz ]; then
  xz -dc devbin/bins.tar.xz | tar xf - -C "$TMP"
  while read -r n; do names+=("$n"); done < <(xz -dc devbin/bins.tar.xz | tar tf -)
fi
for f in devbin/*.xz; do
  [ "$f" = devbin/bins.tar.xz ] && continue
  n=$(basename "$f" .xz)
  xz -dc "$f" > "$TMP/$n"
  chmod +x "$TMP/$n"
  [[ " ${names[*]} " == *" $n "* ]] || names+=("$n")
done
[ ${#names[@]} -gt 0 ] || { echo "no devbin/*.xz to pack" >&2; exit 1; }
# The dictionary must hold more than one binary (~44 MB) for the next to find its twin in it.
(cd "$TMP" && tar cf - "${names[@]}") | xz -T1 --lzma2=preset=6,dict=192MiB > devbin/bins.tar.xz.part
mv devbin/bins.tar.xz.part devbin/bins.tar.xz
for n in "${names[@]}"; do rm -f devbin/"$n".xz; done
ls -la devbin
