#!/usr/bin/env python3
"""Instruction census of a CUDA kernel's main loop, without a GPU: the SASS that ptxas makes for
sm_90, read with nvdisasm, and the innermost loop that holds most of its tensor-core instructions
(HMMA / IMMA) counted by opcode. A kernel change's cost per loop trip, before a device run measures it.

    bench/cuda/sass_loop.py src/kvslim/cuda/attend_codes_half.cu 'half_kernelILi4ELi2ELi128' [--list]

Needs nvcc (12+, the build's) and nvdisasm / ptxas from Debian's nvidia-cuda-toolkit 11.8
(non-free; its nvdisasm cannot read CUDA 13's cubins, so the PTX is assembled again by its ptxas):
    apt-get download nvidia-cuda-toolkit && dpkg-deb -x nvidia-cuda-toolkit_*.deb /opt/cuda118
NVDISASM_ROOT (default /opt/cuda118/usr/bin) names where they are. The build directory's include
paths come from build/src/kvslim (cmake's CUDA response file). Rare branches stay in the count:
--off TEXT (repeatable) compiles one out -- TEXT, an exact `if (...) {` line of the source, becomes
`if (false) {` in a scratch copy beside it -- to see the common path, e.g. the decode codes kernel's
unit without its group's first-unit and last-unit work:
    bench/cuda/sass_loop.py src/kvslim/cuda/attend_codes_half.cu 'half_kernelILi2ELi2ELi128' \
      --off 'if (first_of_group) {' --off 'if (last_of_group) {' --off 'if (a.logits && valid) {' \
      --off 'if (__any_sync(0xffffffffu, mx > m_run + kLeanSlack)) {' \
      --off 'if (!valid || row0 + kGroupRows > seq_limit || newest > qpos) {'
(A value that only a compiled-out branch reads is dropped with it: compile out what the kernel
still needs and the count falls by more than the branch.) -D NAME[=VALUE] (repeatable) compiles with
a build switch, e.g. -D KVSLIM_HALF_STAGES=3. A kernel whose warps take one product each
(attend_codes_half.cu's pairs, KVSLIM_HALF_PAIRED) has a loop per product: --mma IMMA counts the
keys warp's, --mma HMMA the values warp's.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sass_of(source, build, defines=()):
    tools = os.environ.get("NVDISASM_ROOT", "/opt/cuda118/usr/bin")
    rsp = os.path.join(build, "src/kvslim/CMakeFiles/kvslim.dir/includes_CUDA.rsp")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, ptx78, cubin = (os.path.join(tmp, n) for n in ("k.ptx", "k78.ptx", "k.cubin"))
        subprocess.run(["nvcc", "-DKVSLIM_HAVE_CUDA=1", *("-D" + d for d in defines), "--options-file", rsp, "-O3",
                        "-DNDEBUG", "-arch=sm_90", "-ptx", "-std=c++20", "--diag-suppress=177", os.path.abspath(source),
                        "-o", ptx],
                       check=True, cwd=os.path.join(build, "src/kvslim"))
        text = open(ptx).read()
        open(ptx78, "w").write(re.sub(r"^\.version .*$", ".version 7.8", text, count=1, flags=re.M))
        subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90", "-O3", ptx78, "-o", cubin], check=True,
                       stderr=subprocess.DEVNULL)
        return subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], check=True, capture_output=True,
                              text=True).stdout


def loop_census(sass, pattern, mma_ops="[HI]MMA"):
    for f in re.split(r"//-+ \.text\.", sass):
        if not f.strip() or pattern not in f.split()[0]:
            continue
        ins, labels, pending = [], {}, []
        for line in f.splitlines():
            m = re.match(r"^\s*(\.L_x_\d+):", line)
            if m:
                pending.append(m.group(1))
                continue
            m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
            if m:
                a = int(m.group(1), 16)
                for p in pending:
                    labels[p] = a
                pending = []
                ins.append((a, m.group(2).strip()))
        mma = [a for a, b in ins if re.search(r"\b(" + mma_ops + ")", b)]
        if not mma:
            sys.exit(f"{pattern}: no tensor-core instruction")
        # The smallest backward branch's range holding most of the mma (a software-pipelined loop
        # leaves its first trip's products before it).
        need = -(-3 * len(mma) // 5)
        best = None
        for a, b in ins:
            m = re.search(r"BRA.*\((\.L_x_\d+)\)", b)
            if m and labels.get(m.group(1), 1 << 60) < a:
                t = labels[m.group(1)]
                inside = sum(1 for x in mma if t <= x <= a)
                if inside >= need and (best is None or a - t < best[1] - best[0]):
                    best = (t, a)
        if best is None:
            sys.exit(f"{pattern}: no loop holds most of the mma")
        body = [(a, b) for a, b in ins if best[0] <= a <= best[1]]
        return f.split()[0], best, body
    sys.exit(f"{pattern}: no such kernel")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("kernel", help="a substring of the kernel's mangled name")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--list", action="store_true", help="print the loop's instructions too")
    ap.add_argument("--off", action="append", default=[], metavar="TEXT",
                    help="an exact `if (...) {` of the source to compile out (repeatable)")
    ap.add_argument("-D", "--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a macro for the compile (repeatable), e.g. a build switch such as KVSLIM_HALF_STAGES=3")
    ap.add_argument("--mma", default="[HI]MMA", metavar="REGEX",
                    help="the tensor-core opcodes that mark the loop (e.g. IMMA or HMMA: a kernel whose warps "
                         "take different loops, one per product)")
    a = ap.parse_args()
    source = a.source
    if a.off:
        text = open(a.source).read()
        for off in a.off:
            n = text.count(off)
            if n != 1:
                sys.exit(f"--off {off!r}: found {n} times in {a.source}, not once")
            if not re.fullmatch(r"\s*if \(.*\) \{", off):
                sys.exit(f"--off {off!r}: not an `if (...) {{` line")
            text = text.replace(off, off[: off.index("if (")] + "if (false) {")
        # Beside the original, so that its includes resolve the same way.
        fd, source = tempfile.mkstemp(suffix=".cu", prefix=".sass_loop_", dir=os.path.dirname(os.path.abspath(a.source)))
        with os.fdopen(fd, "w") as f:
            f.write(text)
    try:
        name, (t, e), body = loop_census(sass_of(source, a.build, a.define), a.kernel, a.mma)
    finally:
        if source != a.source:
            os.remove(source)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for _, b in body)
    print(f"{name[:160]}\nloop {t:#x}-{e:#x}: {len(body)} instructions a trip (every branch in it counted)")
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))
    if a.list:
        for addr, b in body:
            print(f"{addr:05x} {b}")


if __name__ == "__main__":
    main()
