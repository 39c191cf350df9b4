#!/usr/bin/python3
"""Trains models/mini, a 1.3 M-parameter CPU stand-in for models/tiny, evaluates it
and writes the golden files of the engine parity test (tests/golden/mini).

Why it exists: the GPU time that models/tiny needed ran out, yet `kvslim eval` needs
a real trained model. This one is small enough for a 2-core CPU with Debian's
python3-torch 1.13 (no transformers, no Python tokenizers):
  * tokenizer: the committed models/tiny/tokenizer.json, run by HF tokenizers 0.23.2
    (the Rust library) through its Node binding in training/node (a child process
    speaking JSON lines), so every id is exactly what HF tokenizers produces;
  * model: training/hf_llama.py's re-implementation of LlamaForCausalLM (HF parameter
    names and arithmetic), hidden 128, 4 layers, 2 query / 1 KV head of 64, SwiGLU
    384, tied embeddings, trained in fp32 at context 512;
  * data: corpus windows of training/data/train.txt and packs of the TRAIN retrieval
    families of training/episodes.py (passkey, kvlist, multikey) of 128..512 tokens;
  * stops at --deadline (UTC wall clock), checkpoints every --ckpt-every seconds to
    training/out/ (resumable with --resume), then saves bf16 weights, evaluates them
    upcast to fp32 (models/mini/eval_torch.json) and writes tests/golden/mini/.

    /usr/bin/python3 training/train_mini.py --deadline 05:35            # everything
    /usr/bin/python3 training/train_mini.py --stage finish              # save/eval/golden from the checkpoint
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import episodes as E  # noqa: E402
import hf_llama as H  # noqa: E402

BOS, EOS, PAD = 0, 1, 2
T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - T_START:6.0f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Tokenizer: HF tokenizers (Rust) through the Node binding, one child process.
# ---------------------------------------------------------------------------
_NODE_SERVER = r"""
const tk = require('tokenizers');
const readline = require('readline');
const tok = tk.Tokenizer.fromFile(process.argv[1]);
(async () => {
  const rl = readline.createInterface({input: process.stdin, crlfDelay: Infinity});
  for await (const line of rl) {
    const req = JSON.parse(line);
    let out;
    if (req.op === 'enc') {
      const encs = await tok.encodeBatch(req.texts, {addSpecialTokens: req.special});
      out = encs.map(e => Array.from(e.getIds()));
    } else if (req.op === 'dec') {
      out = await tok.decodeBatch(req.ids, false);
    } else if (req.op === 'id') {
      out = tok.tokenToId(req.token);
    } else {
      throw new Error('unknown op ' + req.op);
    }
    process.stdout.write(JSON.stringify(out) + '\n');
  }
})();
"""


class NodeTokenizer:
    """encode/decode with HF tokenizers 0.23.2 (the same library that wrote the file)."""

    def __init__(self, path: Path):
        if not (HERE / "node" / "node_modules" / "tokenizers").is_dir():
            raise SystemExit("training/node/node_modules/tokenizers missing: run (cd training/node && npm install)")
        env = dict(os.environ, NODE_PATH=str(HERE / "node" / "node_modules"))
        self.proc = subprocess.Popen(["node", "-e", _NODE_SERVER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, bufsize=1 << 20)

    def _ask(self, req: dict):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("tokenizer process died")
        return json.loads(line)

    def encode_batch(self, texts: list[str], special: bool = False) -> list[list[int]]:
        return self._ask({"op": "enc", "texts": texts, "special": special})

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.encode_batch([text], special)[0]

    def decode(self, ids: list[int]) -> str:
        return self._ask({"op": "dec", "ids": [list(map(int, ids))]})[0]

    def token_to_id(self, token: str) -> int:
        return self._ask({"op": "id", "token": token})


def load_lines(path: Path) -> list[str]:
    return [l + "\n" for l in path.read_text(encoding="utf-8").split("\n") if l.strip()]


def tokenize_lines(tok: NodeTokenizer, lines: list[str], chunk: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint16 ids, offsets[n+1]); line i is flat[offsets[i]:offsets[i+1]]."""
    all_ids: list[list[int]] = []
    for i in range(0, len(lines), chunk):
        all_ids += tok.encode_batch(lines[i:i + chunk])
    offsets = np.zeros(len(all_ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in all_ids], out=offsets[1:])
    flat = np.fromiter((t for x in all_ids for t in x), dtype=np.uint16, count=int(offsets[-1]))
    return flat, offsets


def tokenized_corpus(tok: NodeTokenizer, data: Path, cache: Path):
    """Tokenizes train.txt and heldout.txt once (cached in training/out/)."""
    if cache.exists():
        z = np.load(cache)
        return z["flat"], z["offsets"], z["hflat"], z["hoffsets"]
    for name in ("train.txt", "heldout.txt"):
        if not (data / name).exists():
            raise SystemExit(f"{data / name} missing: run scripts/make_corpus.sh")
    flat, offsets = tokenize_lines(tok, load_lines(data / "train.txt"))
    hflat, hoffsets = tokenize_lines(tok, load_lines(data / "heldout.txt"))
    np.savez(cache, flat=flat, offsets=offsets, hflat=hflat, hoffsets=hoffsets)
    return flat, offsets, hflat, hoffsets


class FlatLines(E.FillerSource):
    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def line_ids(self, i: int):
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()


# ---------------------------------------------------------------------------
# Training rows
# ---------------------------------------------------------------------------
class Rows:
    """Rows of ctx tokens: 35 % a corpus window (bos + ctx-1 tokens), 65 % a pack of
    train-family episodes (each bos ... answer eos) of log-uniform length
    min_ep..ctx, the tail (< min_ep tokens) filled with a corpus window."""

    def __init__(self, tok: NodeTokenizer, flat, offsets, ctx: int, seed: int, min_ep: int = 128, p_lm: float = 0.35):
        self.flat, self.ctx, self.min_ep, self.p_lm = flat, ctx, min_ep, p_lm
        self.rng = random.Random(seed)
        self.maker = E.EpisodeMaker(tok.encode, BOS, EOS, tok.token_to_id("Ċ"))
        self.prose = FlatLines(flat, offsets)
        self.grass = E.RepeatedLine(E.GRASS_LINE, self.maker.enc)

    def _corpus(self, n: int) -> list[int]:
        s = self.rng.randrange(len(self.flat) - n)
        return [BOS] + self.flat[s:s + n - 1].tolist()

    def _episode(self, n: int) -> E.Episode:
        rng, m = self.rng, self.maker
        u = rng.random()
        if u < 0.35:
            return m.passkey(self.grass if rng.random() < 0.3 else self.prose, n, rng, add_eos=True)
        if u < 0.65:
            return m.kvlist(n, rng, add_eos=True)
        return m.multikey(self.prose, n, rng, add_eos=True)

    def row(self) -> list[int]:
        ctx, rng = self.ctx, self.rng
        if rng.random() < self.p_lm:
            return self._corpus(ctx)
        row: list[int] = []
        while len(row) < ctx:
            rem = ctx - len(row)
            if rem < self.min_ep:
                row += self._corpus(rem)
                break
            n = ctx if (not row and rng.random() < 0.3) else \
                min(rem, int(math.exp(rng.uniform(math.log(self.min_ep), math.log(ctx)))))
            if rem - n < self.min_ep:
                n = rem
            ep = self._episode(n)
            if len(ep.ids) > rem:  # never cut an answer off
                row += self._corpus(rem)
                break
            row += ep.ids
        return row[:ctx]

    def batch(self, b: int) -> torch.Tensor:
        return torch.tensor([self.row() for _ in range(b)], dtype=torch.long)   # [b, ctx]


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------
def mini_config() -> H.Config:
    return H.Config(model_type="llama", vocab_size=4096, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def init_weights(model: H.CausalLM, seed: int) -> None:
    """HF's init (normal 0.02), with the residual output projections scaled by
    1/sqrt(2 * layers) so the residual stream does not grow with depth."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(2 * model.cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 * (scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)


def lr_at(step: int, frac: float, args) -> float:
    """Linear warmup over --warmup steps, then cosine to 10 % over the wall-clock budget."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def deadline_ts(hhmm: str) -> float:
    now = dt.datetime.now(dt.timezone.utc)
    h, m = map(int, hhmm.split(":"))
    d = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if d < now - dt.timedelta(hours=1):
        d += dt.timedelta(days=1)
    return d.timestamp()


def train(args, tok, flat, offsets) -> None:
    torch.manual_seed(args.seed)
    model = H.CausalLM(mini_config())
    init_weights(model, args.seed)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    rows = Rows(tok, flat, offsets, args.ctx, args.seed)
    state = {"step": 0, "tokens": 0, "train_seconds": 0.0, "loss_ema": None, "t0": time.time(),
             "history": []}
    if args.resume and args.ckpt.exists():
        ck = torch.load(args.ckpt)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        rows.rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"])
        log(f"resumed from {args.ckpt} at step {state['step']}")
    n_params = sum(p.numel() for p in model.parameters())
    end = deadline_ts(args.deadline)
    budget = end - state["t0"]
    log(f"params {n_params:,}; training until {args.deadline} UTC ({(end - time.time()) / 60:.1f} min), "
        f"batch {args.batch} x ctx {args.ctx}, lr {args.lr}, threads {torch.get_num_threads()}")

    def save_ckpt():
        tmp = args.ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "rng": rows.rng.getstate(), "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, args.ckpt)
        log(f"checkpoint step {state['step']} -> {args.ckpt}")

    last_ckpt = time.time()
    model.train()
    while time.time() < end:
        t = time.time()
        x = rows.batch(args.batch)                       # [batch, ctx]
        t_data = time.time() - t
        lr = lr_at(state["step"], (time.time() - state["t0"]) / budget, args)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(x)                                # [batch, ctx, vocab]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        state["step"] += 1
        state["tokens"] += x.numel()
        state["train_seconds"] += time.time() - t
        lv = float(loss)
        state["loss_ema"] = lv if state["loss_ema"] is None else 0.98 * state["loss_ema"] + 0.02 * lv
        if state["step"] % args.log_every == 0 or state["step"] <= 5:
            log(f"step {state['step']} loss {lv:.3f} ema {state['loss_ema']:.3f} lr {lr:.2e} gnorm {gnorm:.2f} "
                f"step {time.time() - t:.2f}s (data {t_data:.2f}s) tokens {state['tokens']:,}")
            state["history"].append([state["step"], round(lv, 4), round(state["loss_ema"], 4)])
        if time.time() - last_ckpt > args.ckpt_every:
            save_ckpt()
            last_ckpt = time.time()
    save_ckpt()
    log(f"training done: {state['step']} steps, {state['tokens']:,} tokens, "
        f"{state['train_seconds'] / 60:.1f} min, loss ema {state['loss_ema']:.3f}")


# ---------------------------------------------------------------------------
# Save, evaluate, golden
# ---------------------------------------------------------------------------
def save_model(args) -> dict:
    ck = torch.load(args.ckpt)
    model = H.CausalLM(mini_config())
    model.load_state_dict(ck["model"])
    out = args.out
    H.save_pretrained(model, out, torch.bfloat16, shards=1, config_style="v4",
                      generation={"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
                                  "do_sample": False})
    link = out / "tokenizer.json"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path("..") / "tiny" / "tokenizer.json")
    size = (out / "model.safetensors").stat().st_size
    log(f"saved {out}: model.safetensors {size:,} bytes")
    assert size < 4 << 20, size
    return ck["state"]


def load_mini(out: Path) -> H.CausalLM:
    """The saved bf16 weights upcast to fp32."""
    model = H.load_pretrained(out, torch.float32)
    return model.eval()


@torch.no_grad()
def teacher_forced_exact(model, eps: list[E.Episode], batch: int = 16) -> list[bool]:
    """Greedy exact match == argmax right at every answer position given the true prefix."""
    out = []
    for i in range(0, len(eps), batch):
        chunk = eps[i:i + batch]
        L = max(len(e.ids) for e in chunk)
        x = torch.full((len(chunk), L), PAD, dtype=torch.long)
        for j, e in enumerate(chunk):  # right-padded; causal attention never sees the pads
            x[j, :len(e.ids)] = torch.tensor(e.ids)
        logits = model(x)
        for j, e in enumerate(chunk):
            n, a = len(e.ids), e.answer_len
            out.append(logits[j, n - a - 1:n - 1].argmax(-1).tolist() == e.ids[n - a:])
    return out


@torch.no_grad()
def greedy(model, prompt: list[int], n_new: int) -> list[int]:
    """n_new argmax steps, full recompute each step (no cache), EOS not special."""
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def retokenize(tok: NodeTokenizer, ep: E.Episode) -> E.Episode:
    """Eval episodes are tokenized from their TEXT, as the C++ evaluator does."""
    ids = tok.encode(ep.text, special=True)
    a_ids = tok.encode(" " + ep.answer)
    assert ids[-len(a_ids):] == a_ids, (ep.answer, ids[-10:], a_ids)
    return E.Episode(ids, len(a_ids), ep.answer, ep.text, ep.kind, ep.depth, ep.meta)


@torch.no_grad()
def perplexity(model, flat: np.ndarray, ctx: int, batch: int = 8) -> tuple[float, int]:
    """Non-overlapping windows of bos + (ctx-1) tokens; NLL over the ctx-1 real tokens."""
    n_win = len(flat) // (ctx - 1)
    rows = [[BOS] + flat[w * (ctx - 1):(w + 1) * (ctx - 1)].tolist() for w in range(n_win)]
    nll, count = 0.0, 0
    for i in range(0, n_win, batch):
        x = torch.tensor(rows[i:i + batch])
        logits = model(x)
        nll += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(nll / count), n_win


def evaluate(args, tok, flat, hflat, hoffsets, state: dict) -> None:
    model = load_mini(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    hist = state["history"]
    res: dict = {"model": "models/mini", "params": n_params, "steps": state["step"], "tokens_seen": state["tokens"],
                 "train_minutes": round(state["train_seconds"] / 60, 1),
                 "batch": state["tokens"] // (state["step"] * args.ctx), "ctx": args.ctx,
                 "lr": args.lr, "seed": args.seed, "final_train_loss_ema": round(state["loss_ema"], 4),
                 "loss_history_step_loss_ema": [" ".join(map(str, h)) for h in hist[::max(1, len(hist) // 16)] + hist[-1:]],
                 "compute": "hf_llama.py forward, bf16 weights upcast to fp32, full attention, no cache, CPU",
                 "accuracy": "greedy exact match of all answer tokens (argmax at each answer position given the "
                             "true prefix); episodes tokenized from their text with <|bos|>"}
    ppl, nw = perplexity(model, hflat[:args.ppl_windows * (args.ctx - 1)], args.ctx)
    res["heldout_ppl"] = {"value": round(ppl, 3), "windows": nw, "window_tokens": args.ctx,
                          "text": f"the first {nw} non-overlapping windows (<|bos|> + {args.ctx - 1} tokens) of "
                                  "training/data/heldout.txt (Devil's Dictionary)"}
    rng_np = np.random.default_rng(0)
    sample = np.concatenate([flat[s:s + args.ctx - 1] for s in rng_np.integers(0, len(flat) - args.ctx, size=32)])
    tppl, _ = perplexity(model, sample, args.ctx)
    res["train_sample_ppl"] = {"value": round(tppl, 3), "windows": 32}
    log(f"heldout ppl {ppl:.2f} ({nw} windows of {args.ctx}); train-sample ppl {tppl:.2f}")

    held_texts = load_lines(args.data / "heldout.txt")
    held_ids = [hflat[hoffsets[i]:hoffsets[i + 1]].tolist() for i in range(len(held_texts))]
    held = E.ListLines(held_texts, held_ids)
    maker = E.EpisodeMaker(tok.encode, BOS, EOS, tok.token_to_id("Ċ"), decode=tok.decode)
    grass = E.RepeatedLine(E.GRASS_LINE, maker.enc)
    rng = random.Random(2024)
    n = args.eval_trials
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]

    def score(make, count=n) -> dict:
        eps = [retokenize(tok, make()) for _ in range(count)]
        ok = teacher_forced_exact(model, eps)
        lens = [len(e.ids) for e in eps]
        return {"accuracy": round(sum(ok) / len(ok), 3), "n": len(ok), "tokens": [min(lens), max(lens)]}

    for length in (256, 512):
        fams = {
            "passkey_train_templates_heldout_prose":
                lambda d: maker.passkey(held, length, rng, digits=5, depth=d),
            "passkey_train_templates_grass":
                lambda d: maker.passkey(grass, length, rng, digits=5, depth=d),
            "vault_heldout_family_heldout_prose":
                lambda d: maker.vault(held, length, rng, depth=d),
            "kvlist_train_family":
                lambda d: maker.kvlist(length, rng, digits=5, depth=d),
            "multikey_train_family_heldout_prose":
                lambda d: maker.multikey(held, length, rng, n_needles=4, digits=5, depth=d),
        }
        block = {}
        for name, make in fams.items():
            by_depth = {f"{int(d * 100)}": score(lambda: make(d)) for d in depths}
            mean = sum(v["accuracy"] for v in by_depth.values()) / len(by_depth)
            block[name] = {"mean": round(mean, 3), "by_depth_percent": by_depth}
            log(f"{length} tokens {name}: mean {mean:.3f} " +
                " ".join(f"{k}%={v['accuracy']:.2f}" for k, v in by_depth.items()))
        res[f"retrieval_{length}_tokens"] = block
    res["chance_note"] = ("5-digit answers: guessing gives ~0; copying any number seen in the context "
                          "gives 1/4 for vault and multikey (4 needles)")
    (args.out / "eval_torch.json").write_text(json.dumps(res, indent=2) + "\n")
    log(f"wrote {args.out / 'eval_torch.json'}")


@torch.no_grad()
def write_golden(args, tok, hflat) -> None:
    model = load_mini(args.out)
    gdir = args.golden
    gdir.mkdir(parents=True, exist_ok=True)
    n_last = 8
    windows = []
    for n, start in ((64, 1000), (256, 5000)):
        ids = [BOS] + hflat[start:start + n - 1].tolist()
        logits = model(torch.tensor([ids]))[0]           # [n, vocab]
        fname = f"window_{n}.logits.f32"
        logits[-n_last:].contiguous().numpy().astype("<f4").tofile(gdir / fname)
        windows.append({"name": f"window_{n}", "n_tokens": n, "heldout_token_offset": start,
                        "input_ids": ids, "logit_positions": list(range(n - n_last, n)),
                        "logits_file": fname, "logits_shape": [n_last, int(logits.size(-1))],
                        "argmax_all_positions": logits.argmax(-1).tolist()})
    maker = E.EpisodeMaker(tok.encode, BOS, EOS, tok.token_to_id("Ċ"), decode=tok.decode)
    grass = E.RepeatedLine(E.GRASS_LINE, maker.enc)
    pk = maker.passkey(grass, 200, random.Random(99), template=0, digits=5, depth=0.5)
    pk_text = pk.text[:-len(" " + pk.answer)]
    n_new = 16
    cases = []
    for text in ("The grass is green. The sky is blue. The sun is yellow.", pk_text):
        ids = tok.encode(text, special=True)
        new = greedy(model, ids, n_new)
        cases.append({"text": text, "input_ids": ids, "greedy_new_ids": new, "greedy_new_text": tok.decode(new)})
    golden = {
        "format": "see tests/golden/README.md (same layout as tests/golden/tiny)",
        "model_dir": "models/mini",
        "compute": "training/hf_llama.py (transformers-equivalent eager forward), weights bf16 upcast to fp32, CPU",
        "logits_encoding": "little-endian float32, row-major [len(logit_positions), vocab]",
        "windows": windows,
        "greedy": {"n_new": n_new, "eos_is_not_special": True, "cases": cases, "passkey_case_answer": pk.answer},
    }
    (gdir / "golden.json").write_text(json.dumps(golden) + "\n")
    log(f"golden -> {gdir}: greedy {cases[0]['greedy_new_text']!r}; passkey case {cases[1]['greedy_new_text']!r} "
        f"(answer {pk.answer})")


def write_heldout_sample(args, n_bytes: int = 100_000) -> None:
    """~100 KB of held-out text (the Devil's Dictionary, public domain), cut at a line end."""
    text = (args.data / "heldout.txt").read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, n_bytes) + 1
    (args.out / "heldout_sample.txt").write_text(text[:cut], encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["all", "train", "finish"], default="all")
    ap.add_argument("--deadline", default="05:35", help="UTC HH:MM when training stops")
    ap.add_argument("--data", type=Path, default=ROOT / "training" / "data")
    ap.add_argument("--work", type=Path, default=ROOT / "training" / "out")
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "mini")
    ap.add_argument("--golden", type=Path, default=ROOT / "tests" / "golden" / "mini")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-threads", type=int, default=2)
    ap.add_argument("--ppl-windows", type=int, default=120, help="held-out windows for perplexity (CPU time)")
    ap.add_argument("--eval-trials", type=int, default=10, help="episodes per (family, length, depth)")
    ap.add_argument("--ckpt-every", type=float, default=300.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.ckpt = args.work / "mini_ckpt.pt"
    torch.set_num_threads(args.threads)
    tok = NodeTokenizer(ROOT / "models" / "tiny" / "tokenizer.json")
    flat, offsets, hflat, hoffsets = tokenized_corpus(tok, args.data, args.work / "mini_tokens.npz")
    log(f"corpus: train {len(flat):,} tokens in {len(offsets) - 1:,} lines; heldout {len(hflat):,} tokens")
    if args.stage in ("all", "train"):
        train(args, tok, flat, offsets)
    if args.stage in ("all", "finish"):
        torch.set_num_threads(args.eval_threads)
        args.out.mkdir(parents=True, exist_ok=True)
        state = save_model(args)
        write_heldout_sample(args)
        write_golden(args, tok, hflat)
        evaluate(args, tok, flat, hflat, hoffsets, state)
    log("done")


if __name__ == "__main__":
    main()
