"""Synthetic long-context retrieval episodes for kvslim's tiny reference model.

Every episode is plain text that ends with its answer, so retrieval is scored by
greedy decoding of the answer tokens. The exact template strings live here and are
copied verbatim into training/README.md, because the C++ evaluator regenerates the
same episodes. Pure Python (no torch, no numpy) so it can be unit-checked anywhere.

Episode layout (all pieces but the last end with "\n", which keeps token boundaries
identical whether the pieces are tokenized one by one or as one string):

    <|bos|>{header}{filler lines with needle lines inserted}{question} {answer}[<|eos|>]

TRAIN families:   passkey (3 templates), kvlist (3 separators), multikey.
HELD-OUT family:  vault (never generated during training).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

# ---------------------------------------------------------------------------
# Template strings (copied into training/README.md; change both together).
# ---------------------------------------------------------------------------
GRASS_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"

PASSKEY_HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                  "Find it and memorize it. I will quiz you about it.\n")
# (needle line, question). The episode ends with f"{question} {key}".
PASSKEY_TEMPLATES = [
    ("The pass key is {key}. Remember it. {key} is the pass key.\n", "What is the pass key? The pass key is"),
    ("The secret number is {key}. Remember the secret number.\n", "What is the secret number? The secret number is"),
    ("Here is the magic number: {key}.\n", "What is the magic number? The magic number is"),
]

KV_HEADER = "Below is a list of keys and their values. Remember them.\n"
KV_SEPARATORS = [": ", " = ", " -> "]
KV_LINE = "{key}{sep}{value}\n"
KV_QUESTION = "What is the value of key {key}? The value of key {key} is"
KV_KEY_FIRST = "abcdefghijklmnopqrstuvwxyz"
KV_KEY_REST = "abcdefghijklmnopqrstuvwxyz0123456789"
KV_KEY_LEN = 6

MULTI_HEADER = "Several codes are hidden in the following text. Remember all of them.\n"
MULTI_NEEDLE = "The code for the {color} {thing} is {key}.\n"
MULTI_QUESTION = "What is the code for the {color} {thing}? The code for the {color} {thing} is"
MULTI_COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "silver", "golden"]
MULTI_THINGS = ["door", "box", "safe", "gate", "chest", "locker", "drawer", "room"]

# Held-out family: never seen in training (new header, needle, question wrapper and keys).
VAULT_HEADER = "Read the following notes carefully.\n"
VAULT_NEEDLE = "Note: the vault combination for {city} is {key}.\n"
VAULT_QUESTION = "Question: What is the vault combination for {city}?\nAnswer: The vault combination for {city} is"
VAULT_CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon",
                "Dublin", "Oslo", "Cairo", "Tokyo", "Lima", "Quito", "Delhi", "Seoul"]
VAULT_NEEDLES_PER_EPISODE = 4  # one queried, three distractors


def random_number(rng: random.Random, digits: int) -> str:
    """A decimal number with exactly `digits` digits (no leading zero)."""
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_kv_key(rng: random.Random) -> str:
    return rng.choice(KV_KEY_FIRST) + "".join(rng.choice(KV_KEY_REST) for _ in range(KV_KEY_LEN - 1))


# ---------------------------------------------------------------------------
# Filler sources: a list of lines (token ids, optionally text), each ending in "\n".
# ---------------------------------------------------------------------------
class FillerSource:
    """Lines of filler prose. `line_ids(i)` gives the token ids of line i (ending in
    the "\n" token); `line_text(i)` the text when known (eval), else None."""

    def __len__(self) -> int:
        raise NotImplementedError

    def line_ids(self, i: int) -> Sequence[int]:
        raise NotImplementedError

    def line_text(self, i: int) -> str | None:
        return None


class RepeatedLine(FillerSource):
    """The classic passkey filler: one sentence line repeated."""

    def __init__(self, text: str, encode: Callable[[str], list[int]]):
        self.text, self.ids = text, list(encode(text))

    def __len__(self) -> int:
        return 1 << 30

    def line_ids(self, i: int) -> Sequence[int]:
        return self.ids

    def line_text(self, i: int) -> str:
        return self.text


class ListLines(FillerSource):
    """Lines held as Python lists (eval: small held-out text)."""

    def __init__(self, texts: list[str], ids: list[list[int]]):
        assert len(texts) == len(ids)
        self.texts, self.ids = texts, ids

    def __len__(self) -> int:
        return len(self.ids)

    def line_ids(self, i: int) -> Sequence[int]:
        return self.ids[i]

    def line_text(self, i: int) -> str:
        return self.texts[i]


@dataclass
class Piece:
    ids: list[int]
    text: str | None


@dataclass
class Episode:
    """ids: the full token sequence (bos first, answer last, eos only if requested).
    answer_len: number of answer tokens at the end (before the optional eos)."""
    ids: list[int]
    answer_len: int
    answer: str
    text: str | None            # full text without specials (None when filler text unknown)
    kind: str
    depth: float | None = None
    meta: dict = field(default_factory=dict)


class EpisodeMaker:
    """Builds episodes at the token level from pre-tokenized pieces.

    encode(text) -> ids without specials; decode(ids) -> text (may be None for
    training, then truncated filler lines have no text)."""

    def __init__(self, encode: Callable[[str], list[int]], bos: int, eos: int,
                 newline_id: int, decode: Callable[[list[int]], str] | None = None):
        self.encode, self.decode = encode, decode
        self.bos, self.eos, self.newline_id = bos, eos, newline_id
        self._cache: dict[str, list[int]] = {}

    def enc(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self.encode(text))
            if len(self._cache) < 4096:
                self._cache[text] = ids
        return ids

    # -- filler ------------------------------------------------------------
    def filler(self, source: FillerSource, n_tokens: int, rng: random.Random) -> list[Piece]:
        """Consecutive lines from a random start, the last one truncated so that the
        total is exactly n_tokens (a truncated line gets a closing "\n")."""
        pieces: list[Piece] = []
        if n_tokens <= 0:
            return pieces
        n_lines = len(source)
        i = rng.randrange(n_lines) if n_lines < (1 << 30) else 0
        total = 0
        while total < n_tokens:
            ids = list(source.line_ids(i % n_lines))
            text = source.line_text(i % n_lines)
            i += 1
            if not ids:
                continue
            room = n_tokens - total
            if len(ids) > room:
                if room < 2:
                    break
                ids = ids[:room - 1] + [self.newline_id]
                text = (self.decode(ids[:-1]) + "\n") if (self.decode and text is not None) else None
            pieces.append(Piece(ids, text))
            total += len(ids)
        return pieces

    @staticmethod
    def insert_at_depth(filler: list[Piece], needle: Piece, depth: float) -> int:
        """Inserts needle at the line boundary closest to `depth` (0..1) of the filler
        tokens; returns the insertion index."""
        total = sum(len(p.ids) for p in filler)
        target = depth * total
        best_i, best_d, acc = 0, abs(target), 0
        for i, p in enumerate(filler):
            acc += len(p.ids)
            if abs(acc - target) < best_d:
                best_i, best_d = i + 1, abs(acc - target)
        filler.insert(best_i, needle)
        return best_i

    def _finish(self, kind: str, pieces: list[Piece], question: str, answer: str,
                add_eos: bool, depth: float | None, meta: dict) -> Episode:
        q_ids = self.enc(question)
        a_ids = self.enc(" " + answer)
        ids = [self.bos]
        texts: list[str] | None = []
        for p in pieces:
            ids.extend(p.ids)
            if texts is not None and p.text is not None:
                texts.append(p.text)
            else:
                texts = None
        ids.extend(q_ids)
        ids.extend(a_ids)
        text = None if texts is None else "".join(texts) + question + " " + answer
        if add_eos:
            ids.append(self.eos)
        return Episode(ids, len(a_ids), answer, text, kind, depth, meta)

    def _piece(self, text: str) -> Piece:
        return Piece(self.enc(text), text)

    # -- families ----------------------------------------------------------
    def passkey(self, source: FillerSource, total_len: int, rng: random.Random, *,
                template: int | None = None, digits: int | None = None,
                depth: float | None = None, add_eos: bool = False) -> Episode:
        """total_len counts bos..answer (+eos when add_eos)."""
        t = rng.randrange(len(PASSKEY_TEMPLATES)) if template is None else template
        key = random_number(rng, rng.randint(3, 7) if digits is None else digits)
        needle_t, question = PASSKEY_TEMPLATES[t]
        header, needle = self._piece(PASSKEY_HEADER), self._piece(needle_t.format(key=key))
        fixed = 1 + len(header.ids) + len(needle.ids) + len(self.enc(question)) + len(self.enc(" " + key)) + int(add_eos)
        pieces = self.filler(source, total_len - fixed, rng)
        depth = rng.random() if depth is None else depth
        self.insert_at_depth(pieces, needle, depth)
        return self._finish("passkey", [header] + pieces, question, key, add_eos, depth, {"template": t})

    def kvlist(self, total_len: int, rng: random.Random, *, sep: int | None = None,
               digits: int | None = None, depth: float | None = None,
               add_eos: bool = False) -> Episode:
        s = KV_SEPARATORS[rng.randrange(len(KV_SEPARATORS)) if sep is None else sep]
        header = self._piece(KV_HEADER)
        lines: list[Piece] = []
        keys: list[str] = []
        values: list[str] = []
        seen: set[str] = set()
        budget = total_len - 1 - len(header.ids) - int(add_eos)
        used = 0
        # The question is ~20 tokens + the answer; reserve 40 to stay under total_len.
        while True:
            key = random_kv_key(rng)
            if key in seen:
                continue
            value = random_number(rng, rng.randint(3, 6) if digits is None else digits)
            piece = self._piece(KV_LINE.format(key=key, sep=s, value=value))
            if used + len(piece.ids) + 40 > budget and len(lines) >= 2:
                break
            seen.add(key)
            keys.append(key)
            values.append(value)
            lines.append(piece)
            used += len(piece.ids)
        depth = rng.random() if depth is None else depth
        qi = min(len(lines) - 1, int(depth * len(lines)))
        question = KV_QUESTION.format(key=keys[qi])
        qa = [(KV_QUESTION.format(key=k), v) for k, v in zip(keys, values)]  # every pair (training extras)
        return self._finish("kvlist", [header] + lines, question, values[qi], add_eos, depth,
                            {"sep": s, "n_pairs": len(lines), "query_index": qi, "qa": qa})

    def _needles_in_filler(self, kind: str, header_text: str, needle_texts: list[str],
                           question: str, answer: str, query: int, source: FillerSource,
                           total_len: int, rng: random.Random, depth: float | None,
                           add_eos: bool, meta: dict) -> Episode:
        header = self._piece(header_text)
        needles = [self._piece(t) for t in needle_texts]
        fixed = (1 + len(header.ids) + sum(len(n.ids) for n in needles) + len(self.enc(question))
                 + len(self.enc(" " + answer)) + int(add_eos))
        pieces = self.filler(source, total_len - fixed, rng)
        depths = [rng.random() for _ in needles]
        if depth is not None:
            depths[query] = depth
        # Insert in descending depth so earlier insertions don't shift later targets much.
        for j in sorted(range(len(needles)), key=lambda j: -depths[j]):
            self.insert_at_depth(pieces, needles[j], depths[j])
        return self._finish(kind, [header] + pieces, question, answer, add_eos, depths[query], meta)

    def multikey(self, source: FillerSource, total_len: int, rng: random.Random, *,
                 n_needles: int | None = None, digits: int | None = None,
                 depth: float | None = None, add_eos: bool = False) -> Episode:
        n = rng.randint(2, 6) if n_needles is None else n_needles
        pairs = rng.sample([(c, t) for c in MULTI_COLORS for t in MULTI_THINGS], n)
        keys: list[str] = []
        while len(keys) < n:
            k = random_number(rng, rng.randint(3, 7) if digits is None else digits)
            if k not in keys:
                keys.append(k)
        q = rng.randrange(n)
        color, thing = pairs[q]
        needle_texts = [MULTI_NEEDLE.format(color=c, thing=t, key=k) for (c, t), k in zip(pairs, keys)]
        question = MULTI_QUESTION.format(color=color, thing=thing)
        qa = [(MULTI_QUESTION.format(color=c, thing=t), k) for (c, t), k in zip(pairs, keys)]
        return self._needles_in_filler("multikey", MULTI_HEADER, needle_texts, question, keys[q], q,
                                       source, total_len, rng, depth, add_eos,
                                       {"n_needles": n, "query_index": q, "qa": qa})

    def vault(self, source: FillerSource, total_len: int, rng: random.Random, *,
              digits: int = 5, depth: float | None = None, add_eos: bool = False) -> Episode:
        """HELD-OUT family: only for evaluation."""
        n = VAULT_NEEDLES_PER_EPISODE
        cities = rng.sample(VAULT_CITIES, n)
        keys: list[str] = []
        while len(keys) < n:
            k = random_number(rng, digits)
            if k not in keys:
                keys.append(k)
        q = rng.randrange(n)
        needle_texts = [VAULT_NEEDLE.format(city=c, key=k) for c, k in zip(cities, keys)]
        question = VAULT_QUESTION.format(city=cities[q])
        return self._needles_in_filler("vault", VAULT_HEADER, needle_texts, question, keys[q], q,
                                       source, total_len, rng, depth, add_eos, {"n_needles": n})
