# Sourced at the start of a device call script (on the GPU machine, in the repository root): $OUT
# made, devbin/ on the library path, the GPU's name and clock in $OUT/gpu.txt, and devbin's binaries
# unpacked -- those pack_devbin.sh packed into devbin/bins.tar.xz and any single devbin/*.xz.
# Once a call: a script it runs that sources this again (device_kernel_ab.sh) keeps what is done.
[ -n "${KVSLIM_DEVICE_PRELUDE_DONE:-}" ] && return 0
export KVSLIM_DEVICE_PRELUDE_DONE=1
export OUT=${OUT:-/tmp/kvslim-device-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/devbin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > "$OUT"/gpu.txt 2>&1
cat "$OUT"/gpu.txt
[ -f devbin/bins.tar.xz ] && xz -dc devbin/bins.tar.xz | tar xf - -C devbin
for f in devbin/*.xz; do
  [ "$f" = devbin/bins.tar.xz ] || { xz -dkf "$f" && chmod +x "${f%.xz}"; }
done
