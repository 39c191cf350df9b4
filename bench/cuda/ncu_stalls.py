#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-line SASS counters: the CSV that
`ncu --section SourceCounters --section WarpStateStats --page source --print-source sass --csv`
writes (bench/cuda/device_run.sh's `profile` step, ncu_sass.csv; .xz is read too). One file: its
stall samples by opcode and by reason, and its hottest lines. Two files (e.g. kivi2 and K4V2 at the
same shape): the same per opcode side by side, each kernel's samples per executed unit of work
(--per NAME=COUNT: the samples divided by COUNT, e.g. the units a call reads), so that the lines
where one kernel spends more than the other show.

    bench/cuda/ncu_stalls.py ncu_sass.csv [--lines 25]
    bench/cuda/ncu_stalls.py kivi2.csv.xz k4v2.csv.xz [--per kivi2=65536 --per k4v2=65536]
"""
import argparse
import collections
import csv
import io
import lzma
import os
import re
import sys


def read_text(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", errors="replace") as f:
        return f.read()


class Kernel:
    """One kernel's lines: (address, source, samples, executed, {reason: samples}); the not-issued
    columns (a subset of the samples) are left out."""

    def __init__(self, name):
        self.name = name
        self.lines = []


def parse(path):
    """The kernels of one CSV, in order (ncu prints a "Kernel Name" row, then a header, then lines)."""
    kernels, kernel, header = [], None, None
    for row in csv.reader(io.StringIO(read_text(path))):
        if not row:
            continue
        if row[0] == "Kernel Name" and len(row) > 1:
            kernel = Kernel(row[1])
            kernels.append(kernel)
            header = None
            continue
        if row[0] == "Address" and len(row) > 2 and row[1] == "Source":
            header = {name: i for i, name in enumerate(row)}
            if kernel is None:
                kernel = Kernel("(unnamed)")
                kernels.append(kernel)
            continue
        if header is None or not row[0].startswith("0x"):
            continue

        def num(column):
            i = header.get(column)
            if i is None or i >= len(row):
                return 0
            try:
                return int(float(row[i] or 0))
            except ValueError:
                return 0

        reasons = {}
        for name, i in header.items():
            if name.startswith("stall_") and not name.endswith("(Not Issued)"):
                value = num(name)
                if value:
                    reasons[name[len("stall_"):]] = value
        kernel.lines.append((int(row[0], 16), row[1].strip(), num("Warp Stall Sampling (All Samples)"),
                             num("Instructions Executed"), reasons))
    if not kernels or not any(k.lines for k in kernels):
        sys.exit(f"{path}: no SASS lines with stall samples (is it ncu's --page source --csv output?)")
    return [k for k in kernels if k.lines]


def opcode(source):
    """The opcode of a SASS line without its predicate and modifiers: `@!P0 LOP3.LUT R1, ...` -> LOP3."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def by_opcode(kernel):
    samples, executed, reasons = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for _, source, s, e, r in kernel.lines:
        op = opcode(source)
        samples[op] += s
        executed[op] += e
        reasons[op].update(r)
    return samples, executed, reasons


def top_reasons(counter, total, n=3):
    return ", ".join(f"{k} {100.0 * v / total:.0f}%" for k, v in counter.most_common(n) if total)


def short_name(name):
    m = re.search(r"(attend\w*|\w+_kernel)<([^>]*)>", name)
    return f"{m.group(1)}<{m.group(2)}>" if m else name[:80]


def report_one(kernel, n_lines):
    samples, executed, reasons = by_opcode(kernel)
    total = sum(samples.values())
    all_reasons = collections.Counter()
    for r in reasons.values():
        all_reasons.update(r)
    base = kernel.lines[0][0]
    print(f"== {short_name(kernel.name)}: {total} samples, {sum(executed.values())} warp instructions executed")
    print("stall reasons: " + top_reasons(all_reasons, sum(all_reasons.values()), 8))
    print(f"{'opcode':10} {'samples':>8} {'share':>6} {'executed':>10} {'samples/1k exec':>15}  reasons")
    for op, s in samples.most_common(20):
        per = 1000.0 * s / executed[op] if executed[op] else 0.0
        print(f"{op:10} {s:8d} {100.0 * s / total:5.1f}% {executed[op]:10d} {per:15.1f}  "
              f"{top_reasons(reasons[op], sum(reasons[op].values()))}")
    print("hottest lines (offset from the kernel's first line):")
    for addr, source, s, e, r in sorted(kernel.lines, key=lambda x: -x[2])[:n_lines]:
        print(f"  +0x{addr - base:05x} {s:6d} {100.0 * s / total:5.1f}%  {source[:60]:60}  "
              f"{top_reasons(collections.Counter(r), sum(r.values()), 2)}")


def report_pair(a, b, per_a, per_b, label_a, label_b):
    sa, ea, ra = by_opcode(a)
    sb, eb, rb = by_opcode(b)
    print(f"== {label_a}: {short_name(a.name)}  {sum(sa.values())} samples / {per_a:g}")
    print(f"== {label_b}: {short_name(b.name)}  {sum(sb.values())} samples / {per_b:g}")
    print(f"{'opcode':10} {label_a + ' samples':>16} {label_b + ' samples':>16} {'difference':>11}  "
          f"{label_a + ' executed':>16} {label_b + ' executed':>16}  (samples per 1,000 and warp instructions per one unit of --per)")
    ops = set(sa) | set(sb)
    rows = sorted(ops, key=lambda op: -abs(sa[op] / per_a - sb[op] / per_b))
    for op in rows:
        da, db = 1000.0 * sa[op] / per_a, 1000.0 * sb[op] / per_b
        if max(da, db) <= 0:
            continue
        print(f"{op:10} {da:16.1f} {db:16.1f} {da - db:+11.1f}  {ea[op] / per_a:16.2f} {eb[op] / per_b:16.2f}")
    ta = 1000.0 * sum(sa.values()) / per_a
    tb = 1000.0 * sum(sb.values()) / per_b
    print(f"{'total':10} {ta:16.1f} {tb:16.1f} {ta - tb:+11.1f}  {sum(ea.values()) / per_a:16.2f} {sum(eb.values()) / per_b:16.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="one or two ncu source CSVs (.csv or .csv.xz)")
    ap.add_argument("--lines", type=int, default=25, help="hottest lines to print (one file)")
    ap.add_argument("--per", action="append", default=[],
                    help="NAME=COUNT: divide that file's samples by COUNT (NAME: the file's name up to its first '.')")
    args = ap.parse_args()
    if len(args.csv) > 2:
        ap.error("one or two CSVs")
    kernels = []
    for path in args.csv:
        if not os.path.exists(path):
            ap.error(f"{path}: no such file")
        found = parse(path)
        if len(found) > 1:
            print(f"{path}: {len(found)} kernels; the first is read ({short_name(found[0].name)})", file=sys.stderr)
        kernels.append(found[0])
    if len(kernels) == 1:
        report_one(kernels[0], args.lines)
        return
    labels = [os.path.basename(p).split(".")[0] for p in args.csv]
    per = {label: 1.0 for label in labels}
    for item in args.per:
        name, sep, count = item.partition("=")
        if not sep or name not in per:
            ap.error(f"--per {item}: want NAME=COUNT with NAME one of {', '.join(labels)}")
        try:
            per[name] = float(count)
        except ValueError:
            ap.error(f"--per {item}: COUNT is not a number")
        if per[name] <= 0:
            ap.error(f"--per {item}: COUNT must be positive")
    report_pair(kernels[0], kernels[1], per[labels[0]], per[labels[1]], labels[0], labels[1])


if __name__ == "__main__":
    main()
