#!/usr/bin/env bash
# Builds the plain-text training corpus for kvslim's tiny reference model from
# public-domain Debian packages (see /work/shared/docs/engine-notes.md section 3).
#
#   scripts/make_corpus.sh [OUT_DIR]     (default: training/data)
#
# Writes OUT_DIR/train.txt and OUT_DIR/heldout.txt. The held-out file is the whole
# Devil's Dictionary (dict-devil), a book the training text never contains.
# Documents are separated by a blank line; paragraphs are unwrapped to one line.
# Needs only apt-get download (no root install), dpkg -x and python3 (stdlib).
set -euo pipefail

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
out_dir="${1:-$repo_root/training/data}"
work_dir="$(mktemp -d)"
trap 'rm -rf "$work_dir"' EXIT

packages=(sword-text-web sword-text-kjv sword-comm-tdavid sword-comm-mhcc jargon-text dict-devil)
mkdir -p "$work_dir/debs" "$work_dir/root" "$out_dir"
(cd "$work_dir/debs" && apt-get download "${packages[@]}")
for deb in "$work_dir"/debs/*.deb; do
  dpkg -x "$deb" "$work_dir/root"
done

python3 - "$work_dir/root" "$out_dir" <<'PY'
import gzip, html, re, struct, sys, zlib
from pathlib import Path

root, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
sword = root / "usr/share/sword/modules"

def sword_blocks(module_dir: Path):
    """Yields the decompressed OSIS XML blocks of a SWORD zText/zCom module.
    Index *.bzs/*.czs: 12-byte LE records (offset, size, uncompressed size) into
    the zlib blocks stored back to back in *.bzz/*.czz."""
    for testament in ("ot", "nt"):
        for ext in ("b", "c"):
            idx_path = module_dir / f"{testament}.{ext}zs"
            dat_path = module_dir / f"{testament}.{ext}zz"
            if not idx_path.exists():
                continue
            idx, dat = idx_path.read_bytes(), dat_path.read_bytes()
            if len(idx) % 12:
                raise SystemExit(f"{idx_path}: size {len(idx)} is not a multiple of 12")
            for i in range(len(idx) // 12):
                off, size, usize = struct.unpack_from("<III", idx, i * 12)
                if size == 0:
                    continue
                block = zlib.decompress(dat[off:off + size])
                yield block.decode("utf-8", errors="replace")

NOTE = re.compile(r"<note\b.*?</note>", re.S)
TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
PARA_BREAK = re.compile(r"<(?:div|p|lb|lg|l|chapter)\b[^>]*/?>|</(?:p|div|lg|l)>")
TAG = re.compile(r"<[^>]+>")

def osis_to_text(xml: str) -> str:
    xml = NOTE.sub(" ", xml)                      # footnotes / translator notes
    xml = TITLE.sub(lambda m: "\n" + m.group(1) + "\n", xml)
    xml = PARA_BREAK.sub("\n", xml)
    text = html.unescape(TAG.sub("", xml))
    return text

def tidy(text: str) -> str:
    """One paragraph per line, single spaces, no empty lines inside a document."""
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"[ \t\u00a0]+", " ", line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines)

def sword_module(rel: str) -> str:
    return tidy("\n".join(osis_to_text(b) for b in sword_blocks(sword / rel)))

def unwrap(text: str) -> str:
    """Joins hard-wrapped lines into paragraphs (blank line = paragraph break)."""
    paras = re.split(r"\n\s*\n", text)
    return "\n".join(p for p in (re.sub(r"\s+", " ", q).strip() for q in paras) if p)

def jargon() -> str:
    raw = gzip.open(root / "usr/share/doc/jargon-text/jargon.txt.gz", "rt",
                    encoding="utf-8", errors="replace").read()
    # Drop box-drawing table rows (the abbreviation tables) and keep the prose.
    raw = "\n".join(l for l in raw.split("\n") if not re.search(r"[\u2500-\u257f]", l))
    return unwrap(raw)

def devil() -> str:
    raw = gzip.open(root / "usr/share/dictd/devil.dict.dz", "rt",
                    encoding="utf-8", errors="replace").read()
    raw = "\n".join(l for l in raw.split("\n") if not l.startswith("00-database"))
    return unwrap(raw)

train_parts = [
    ("tdavid", sword_module("comments/zcom/tdavid")),
    ("mhcc", sword_module("comments/zcom/mhcc")),
    ("web", sword_module("texts/ztext/engWEB2015eb")),
    ("kjv", sword_module("texts/ztext/engKJV2006eb")),
    ("jargon", jargon()),
]
held = devil()

with open(out_dir / "train.txt", "w", encoding="utf-8") as f:
    for name, text in train_parts:
        f.write(text.strip() + "\n\n")
        print(f"train  {name:8s} {len(text.encode()):>10,d} bytes")
with open(out_dir / "heldout.txt", "w", encoding="utf-8") as f:
    f.write(held.strip() + "\n")
print(f"heldout devil    {len(held.encode()):>10,d} bytes")
PY
ls -l "$out_dir"
