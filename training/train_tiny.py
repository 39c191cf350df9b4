#!/usr/bin/env python3
"""Trains kvslim's shipped reference model (models/tiny), evaluates it with HF and
writes the golden files of the C++ engine parity test (tests/golden/tiny).

Runs on a GPU machine (torch, transformers >= 4.45, tokenizers). See training/README.md
for the exact command and the measured results. Stages:
  1. tokenizer: models/tiny/tokenizer.json, made by training/node/build_tokenizers.js
     (byte-level BPE, vocab 4096; the golden tokenizer ids refer to this file);
  2. data: the corpus, tokenized line by line, mixed with synthetic retrieval episodes
     generated on the fly (training/episodes.py; the held-out "vault" family never);
  3. model: LlamaForCausalLM, 8 layers, hidden 256, 4 query / 2 KV heads of 64, untied;
     bf16 autocast, SDPA, AdamW, warmup + cosine, stops before --deadline;
  4. save bf16, >= 2 safetensors shards + index, tokenizer files;
  5. eval (bf16 weights upcast to fp32, SDPA, full cache) -> models/tiny/eval_hf.json;
  6. golden fp32 eager logits on CPU -> tests/golden/tiny/.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import episodes as E  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2
BOS, EOS, PAD = 0, 1, 2
T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------
def load_lines(path: Path) -> list[str]:
    """Non-empty lines, each ending in "\n"; reads PATH or, when absent, PATH.xz."""
    if not path.exists() and path.with_name(path.name + ".xz").exists():
        import lzma
        text = lzma.open(path.with_name(path.name + ".xz"), "rt", encoding="utf-8").read()
    else:
        text = path.read_text(encoding="utf-8")
    return [l + "\n" for l in text.split("\n") if l.strip()]


def tokenize_file(tok, path: Path, cache_dir: Path | None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(lines, flat ids, offsets), cached as .npz under cache_dir (a second process in the same
    device call, e.g. after the smoke test, skips the tokenization)."""
    lines = load_lines(path)
    cache = None if cache_dir is None else cache_dir / f"{path.name}.{len(lines)}.npz"
    if cache is not None and cache.exists():
        z = np.load(cache)
        return lines, z["flat"], z["offsets"]
    flat, offsets = tokenize_lines(tok, lines)
    if cache is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cache, flat=flat, offsets=offsets)
    return lines, flat, offsets


def tokenize_lines(tok, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Returns (flat uint16 ids, offsets[n+1]); line i is flat[offsets[i]:offsets[i+1]]."""
    encs = tok.encode_batch(lines, add_special_tokens=False)
    lens = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    offsets = np.zeros(len(encs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.uint16)
    for i, e in enumerate(encs):
        flat[offsets[i]:offsets[i + 1]] = e.ids
    return flat, offsets


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
class RowStream(torch.utils.data.IterableDataset):
    """Yields [batch, ctx] int64 tensors; each row is either a plain corpus window
    (bos + ctx-1 tokens) or a pack of retrieval episodes (each bos...answer eos),
    the tail filled with a corpus window."""

    def __init__(self, tok, flat, offsets, ctx, batch, seed, p_lm=0.35, answer_weight=3.0):
        self.tok, self.flat, self.offsets = tok, flat, offsets
        self.ctx, self.batch, self.seed, self.p_lm = ctx, batch, seed, p_lm
        self.answer_weight = answer_weight

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        rng = random.Random(self.seed * 1000 + wid)
        tok = self.tok
        maker = E.EpisodeMaker(lambda s: tok.encode(s, add_special_tokens=False).ids, BOS, EOS,
                               tok.token_to_id("Ċ"))
        prose = FlatLines(self.flat, self.offsets)
        grass = E.RepeatedLine(E.GRASS_LINE, maker.enc)
        while True:
            rows = np.empty((self.batch, self.ctx), dtype=np.int64)
            weights = np.ones((self.batch, self.ctx), dtype=np.float32)
            for b in range(self.batch):
                ids, w = self._row(rng, maker, prose, grass)
                rows[b], weights[b] = ids, w
            yield torch.from_numpy(rows), torch.from_numpy(weights)

    def _corpus(self, rng, n):
        s = rng.randrange(len(self.flat) - n)
        return [BOS] + self.flat[s:s + n - 1].tolist()

    def _episode(self, rng, maker, prose, grass, n):
        """One training episode of about n tokens: ids and per-token loss weights. kvlist and
        multikey episodes get up to 3 extra question/answer lines after the first answer (the
        first keeps the evaluation format exactly): more retrieval supervision per token."""
        u = rng.random()
        extra = rng.randint(0, 3) if u >= 0.30 else 0
        reserve = 30 * extra
        if u < 0.30:
            ep = maker.passkey(grass if rng.random() < 0.3 else prose, n - 1, rng)
        elif u < 0.65:
            ep = maker.kvlist(n - 1 - reserve, rng)
        else:
            ep = maker.multikey(prose, n - 1 - reserve, rng)
        ids = list(ep.ids)
        w = [1.0] * len(ids)
        for k in range(len(ids) - ep.answer_len, len(ids)):
            w[k] = self.answer_weight
        qa = ep.meta.get("qa", [])
        order = [j for j in range(len(qa)) if j != ep.meta.get("query_index")]
        rng.shuffle(order)
        for j in order[:extra]:
            q, a = qa[j]
            q_ids, a_ids = maker.enc("\n" + q), maker.enc(" " + a)
            ids += q_ids + a_ids
            w += [1.0] * len(q_ids) + [self.answer_weight] * len(a_ids)
        ids.append(EOS)
        w.append(1.0)
        return ids, w

    def _row(self, rng, maker, prose, grass):
        ctx = self.ctx
        if rng.random() < self.p_lm:
            return self._corpus(rng, ctx), [1.0] * ctx
        row: list[int] = []
        wts: list[float] = []
        while len(row) < ctx:
            rem = ctx - len(row)
            if rem < 256:
                row += self._corpus(rng, rem)
                break
            if not row and rng.random() < 0.5:
                n = ctx
            else:
                n = min(rem, int(math.exp(rng.uniform(math.log(192), math.log(ctx)))))
            if rem - n < 256:
                n = rem
            ids, w = self._episode(rng, maker, prose, grass, n)
            if len(ids) > rem:  # never cut an answer off: fill with corpus instead
                row += self._corpus(rng, rem)
                break
            row += ids
            wts += w
        wts += [1.0] * (len(row) - len(wts))
        return row[:ctx], wts[:ctx]


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------
def rope_kwargs(config_cls, theta: float, scaling: dict | None = None) -> dict:
    """transformers >= 5 takes rope_parameters, older versions rope_theta/rope_scaling."""
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    kw = {"rope_theta": theta}
    if scaling:
        kw["rope_scaling"] = dict(scaling)
    return kw


def make_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=args.ctx, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.02,
        **rope_kwargs(LlamaConfig, 10000.0))


def load_model(path, dtype, attn, device):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(path), attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------
# Evaluation helpers
# ---------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_exact(model, eps: list[E.Episode], device, batch=16) -> list[bool]:
    """Exact match of greedy decoding == argmax at every answer position given the
    correct prefix (greedy produces the answer iff each step's argmax is right)."""
    out = []
    for i in range(0, len(eps), batch):
        chunk = eps[i:i + batch]
        L = max(len(e.ids) for e in chunk)
        x = torch.full((len(chunk), L), PAD, dtype=torch.long)
        for j, e in enumerate(chunk):  # right-padded; causal attention never sees pads
            x[j, :len(e.ids)] = torch.tensor(e.ids)
        logits = model(input_ids=x.to(device)).logits
        for j, e in enumerate(chunk):
            n, a = len(e.ids), e.answer_len
            pred = logits[j, n - a - 1:n - 1].argmax(-1).cpu().tolist()
            out.append(pred == e.ids[n - a:])
    return out


@torch.no_grad()
def greedy_with_cache(model, prompt: list[int], n_new: int, device) -> list[int]:
    """Greedy decoding with HF's KV cache, n_new argmax steps, EOS not special."""
    x = torch.tensor([prompt], device=device)
    outp = model(input_ids=x, use_cache=True)
    cache, nxt = outp.past_key_values, int(outp.logits[0, -1].argmax())
    new = [nxt]
    for _ in range(n_new - 1):
        outp = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=cache, use_cache=True)
        cache, nxt = outp.past_key_values, int(outp.logits[0, -1].argmax())
        new.append(nxt)
    return new


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95 % Wilson score interval of a binomial proportion k/n."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


def retokenize(tok, ep: E.Episode) -> E.Episode:
    """Eval episodes are tokenized from their TEXT, as the C++ evaluator will do."""
    ids = tok.encode(ep.text, add_special_tokens=True).ids
    a_ids = tok.encode(" " + ep.answer, add_special_tokens=False).ids
    assert ids[-len(a_ids):] == a_ids, (ep.answer, ids[-10:], a_ids)
    return E.Episode(ids, len(a_ids), ep.answer, ep.text, ep.kind, ep.depth, ep.meta)


@torch.no_grad()
def perplexity(model, flat: np.ndarray, ctx: int, device, max_windows: int, batch=8) -> tuple[float, int]:
    """Non-overlapping windows: bos + (ctx-1) tokens; NLL over the ctx-1 real tokens."""
    n_win = min(max_windows, len(flat) // (ctx - 1))
    rows = [[BOS] + flat[w * (ctx - 1):(w + 1) * (ctx - 1)].tolist() for w in range(n_win)]
    nll, count = 0.0, 0
    for i in range(0, n_win, batch):
        x = torch.tensor(rows[i:i + batch], device=device)
        logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        nll += float(loss)
        count += x[:, 1:].numel()
    return math.exp(nll / count), n_win


def save_model(model, args, tok_note: str) -> None:
    """bf16 copy of the model (the training weights stay fp32), >= 2 shards + index, tokenizer
    and generation configs."""
    import copy
    from transformers import GenerationConfig
    snap = copy.deepcopy(model).to(torch.bfloat16).eval()
    snap.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                              do_sample=False, max_length=args.ctx)
    snap.save_pretrained(str(args.out), max_shard_size="10MB")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "add_bos_token": True, "add_eos_token": False,
        "model_max_length": args.ctx, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, s in enumerate(SPECIALS)},
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    shards = sorted(p.name for p in args.out.glob("*.safetensors"))
    log(f"saved {args.out} ({tok_note}): {shards}")
    assert len(shards) >= 2 and (args.out / "model.safetensors.index.json").exists(), shards
    del snap


# ---------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("training/data"))
    ap.add_argument("--out", type=Path, default=Path("models/tiny"))
    ap.add_argument("--golden", type=Path, default=Path("tests/golden/tiny"))
    ap.add_argument("--tokenizer", type=Path, default=Path("models/tiny/tokenizer.json"))
    ap.add_argument("--export", type=Path, default=None,
                    help="copy the saved model here as soon as it is written (the device's $OUT)")
    ap.add_argument("--init-from", type=Path, default=None, help="resume from a saved model dir")
    ap.add_argument("--deadline", type=float, default=None, help="unix time by which everything must be written")
    ap.add_argument("--eval-reserve", type=float, default=120.0, help="seconds kept for save+eval+golden")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--p-lm", type=float, default=0.4, help="fraction of rows that are plain corpus windows")
    ap.add_argument("--answer-weight", type=float, default=3.0, help="loss weight of retrieval answer tokens")
    ap.add_argument("--token-cache", type=Path, default=Path("training/out/tokens"))
    ap.add_argument("--ckpt-every", type=float, default=150.0, help="seconds between weight exports while training")
    ap.add_argument("--smoke", action="store_true", help="a few steps and tiny evaluations: checks every stage")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--eval-only", action="store_true", help="skip training; evaluate --out")
    ap.add_argument("--eval-trials", type=int, default=20, help="passkey episodes per depth and filler")
    args = ap.parse_args()
    deadline = args.deadline or (time.time() + 540)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers
    import tokenizers
    log(f"torch {torch.__version__} transformers {transformers.__version__} tokenizers {tokenizers.__version__} device {device}")

    # 1. tokenizer -------------------------------------------------------------
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.tokenizer))
    if tok.get_vocab_size() != args.vocab or tok.token_to_id("<|bos|>") != BOS or tok.token_to_id("<|eos|>") != EOS:
        raise SystemExit(f"{args.tokenizer}: expected vocab {args.vocab} with <|bos|>=0 <|eos|>=1")
    log(f"tokenizer {args.tokenizer} (made by training/node/build_tokenizers.js)")
    args.out.mkdir(parents=True, exist_ok=True)
    if (args.out / "tokenizer.json").resolve() != args.tokenizer.resolve():
        shutil.copyfile(args.tokenizer, args.out / "tokenizer.json")

    # 2. data ------------------------------------------------------------------
    t_tok = time.time()
    _, flat, offsets = tokenize_file(tok, args.data / "train.txt", args.token_cache)
    held_lines, hflat, hoffsets = tokenize_file(tok, args.data / "heldout.txt", args.token_cache)
    indist_path = args.data / "heldout_indist.txt"
    ind_lines, iflat, ioffsets = tokenize_file(tok, indist_path, args.token_cache) if indist_path.exists() else ([], None, None)
    log(f"corpus: train {len(offsets) - 1} lines {len(flat):,} tokens; heldout (out-of-domain) {len(held_lines)} lines "
        f"{len(hflat):,} tokens; heldout in-distribution {0 if iflat is None else len(iflat):,} tokens "
        f"(tokenized in {time.time() - t_tok:.1f} s)")
    if args.smoke:
        args.max_steps, args.eval_trials, args.warmup = 6, 2, 2
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # workers are forked after this point

    prior = {}
    n_params = step = tokens_seen = train_seconds = loss_ema = None
    if args.eval_only:
        prev = args.out / "eval_hf.json"
        if prev.exists():
            prior = json.loads(prev.read_text())
        n_params, step, tokens_seen = prior.get("params"), prior.get("steps"), prior.get("tokens_seen")
        train_seconds, loss_ema = prior.get("train_seconds"), prior.get("final_train_loss_ema")
        log("eval only: skipping training")
    else:
        # 3. model -----------------------------------------------------------------
        from transformers import GenerationConfig, LlamaForCausalLM  # noqa: F401
        if args.init_from:
            prev = args.init_from / "eval_hf.json"
            if prev.exists():
                prior = json.loads(prev.read_text())
            model = LlamaForCausalLM.from_pretrained(str(args.init_from), attn_implementation="sdpa").float()
            log(f"resumed weights from {args.init_from}")
        else:
            config = make_config(args)
            try:
                config._attn_implementation = "sdpa"
            except Exception as exc:  # noqa: BLE001 - older/newer transformers differ here
                log(f"could not preset attention implementation: {exc}")
            model = LlamaForCausalLM(config)
        model.to(device).train()
        n_params = sum(p.numel() for p in model.parameters())
        log(f"params {n_params:,}; attn {model.config._attn_implementation}")

        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device == "cuda" else {}))

        stream = RowStream(tok, flat, offsets, args.ctx, args.batch, args.seed, p_lm=args.p_lm,
                           answer_weight=args.answer_weight)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                             pin_memory=(device == "cuda"), **({"prefetch_factor": 4} if args.workers else {}),
                                             persistent_workers=False)
        it = iter(loader)

        train_stop = deadline - args.eval_reserve
        t_train0 = time.time()
        total_steps = args.max_steps          # re-estimated after the step time is known
        step, tokens_seen, t_loop0, data_wait = 0, 0, None, 0.0
        last_ckpt = time.time()
        loss_ema = None
        while step < total_steps:
            now = time.time()
            if now >= train_stop:
                log(f"wall-clock stop at step {step}")
                break
            if step < args.warmup:
                lr = args.lr * (step + 1) / args.warmup
            else:
                prog = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
                lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.time()
            x, wts = next(it)
            x, wts = x.to(device, non_blocking=True), wts.to(device, non_blocking=True)
            data_wait += time.time() - t0
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=(device == "cuda")):
                logits = model(input_ids=x).logits
            ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="none")
            w = wts[:, 1:].reshape(-1)
            loss = (ce * w).sum() / w.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += x.numel()
            if args.export and time.time() - last_ckpt > args.ckpt_every:
                save_model(model, args, tok_note="checkpoint")
                export(args.out, args.export)
                last_ckpt = time.time()
                model.train()
            if step == 20:
                torch.cuda.synchronize() if device == "cuda" else None
                t_loop0 = time.time()
            if step == 80 and t_loop0 is not None:
                torch.cuda.synchronize() if device == "cuda" else None
                per_step = (time.time() - t_loop0) / 60
                total_steps = min(args.max_steps, step + int((train_stop - time.time()) / per_step * 0.97))
                log(f"step time {per_step * 1000:.1f} ms -> total_steps {total_steps}")
            if step % 100 == 0 or step == 1:
                lv = float(loss)
                loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
                log(f"step {step:6d}/{total_steps} loss {lv:.4f} ema {loss_ema:.4f} lr {lr:.2e} tokens {tokens_seen:,} data_wait {data_wait:.1f}s")
            if step % 1000 == 0 or (args.smoke and step == 3):
                model.eval()
                rng = random.Random(7)
                maker = E.EpisodeMaker(lambda s: tok.encode(s, add_special_tokens=False).ids, BOS, EOS, tok.token_to_id("Ċ"))
                probe = [maker.passkey(FlatLines(hflat, hoffsets), args.ctx, rng, template=0, digits=5) for _ in range(16)]
                probe_kv = [maker.kvlist(args.ctx - 8, rng, digits=5) for _ in range(16)]
                probe_mk = [maker.multikey(FlatLines(hflat, hoffsets), args.ctx - 8, rng, n_needles=4, digits=5) for _ in range(16)]
                with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=(device == "cuda")):
                    accs = [sum(teacher_forced_exact(model, pr, device)) / len(pr) for pr in (probe, probe_kv, probe_mk)]
                log(f"probe @{args.ctx}: passkey {accs[0]:.2f} kvlist {accs[1]:.2f} multikey {accs[2]:.2f}")
                model.train()
        train_seconds = time.time() - t_train0
        del it, loader

        # 4. save ------------------------------------------------------------------
        model.eval()
        save_model(model, args, tok_note="final")
        if args.export:
            export(args.out, args.export)
        del model, opt
        torch.cuda.empty_cache() if device == "cuda" else None

    # 5. eval (saved bf16 weights, fp32 compute, SDPA) -----------------------
    model = load_model(args.out, torch.float32, "sdpa", device)
    results: dict = {"params": n_params, "steps": step, "tokens_seen": tokens_seen,
                     "train_seconds": None if train_seconds is None else round(train_seconds, 1), "batch": args.batch, "ctx": args.ctx,
                     "lr": args.lr, "seed": args.seed, "resumed_from": str(args.init_from) if args.init_from else None,
                     "final_train_loss_ema": loss_ema,
                     "earlier_run": {k: prior.get(k) for k in ("steps", "tokens_seen", "train_seconds", "lr")} if prior else None,
                     "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "weights": "bf16 upcast to fp32 for evaluation"}
    results["architecture"] = {k: getattr(model.config, k) for k in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings")}
    n_win = 2 if args.smoke else 1000
    try:
        ppl, nw = perplexity(model, hflat, args.ctx, device, max_windows=n_win)
        results["heldout_ppl"] = {"value": ppl, "windows": nw, "window": args.ctx,
                                  "text": "heldout.txt (The Devil's Dictionary: out-of-domain, a source absent from training)"}
        if iflat is not None:
            ippl, iw = perplexity(model, iflat, args.ctx, device, max_windows=n_win)
            results["heldout_indist_ppl"] = {"value": ippl, "windows": iw, "window": args.ctx,
                                             "text": "heldout_indist.txt (documents of every training source, never trained on)"}
        rng_np = np.random.default_rng(0)
        starts = rng_np.integers(0, len(flat) - args.ctx, size=64)
        sample = np.concatenate([flat[s:s + args.ctx - 1] for s in starts])
        tppl, tw = perplexity(model, sample, args.ctx, device, max_windows=64)
        results["train_sample_ppl"] = {"value": tppl, "windows": tw}
        if iflat is not None:
            results["indist_over_train_ppl"] = results["heldout_indist_ppl"]["value"] / tppl
        log(f"heldout ppl: out-of-domain {ppl:.2f} ({nw} windows); in-distribution "
            f"{results.get('heldout_indist_ppl', {}).get('value', float('nan')):.2f}; train-sample {tppl:.2f}")

        held_texts = held_lines
        held_ids = [hflat[hoffsets[i]:hoffsets[i + 1]].tolist() for i in range(len(held_lines))]
        held_src = E.ListLines(held_texts, held_ids)
        maker = E.EpisodeMaker(lambda s: tok.encode(s, add_special_tokens=False).ids, BOS, EOS,
                               tok.token_to_id("Ċ"), decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
        grass = E.RepeatedLine(E.GRASS_LINE, maker.enc)
        rng = random.Random(2024)
        depths = [d / 10 for d in range(11)]
        target = args.ctx - 8  # margin: retokenizing the text can merge a few tokens differently

        def run(eps):
            eps = [retokenize(tok, e) for e in eps]
            ok = teacher_forced_exact(model, eps, device)
            return eps, ok

        passkey: dict = {}
        all_eps = []
        all_ok: dict = {}
        for fname, src in (("grass", grass), ("heldout_prose", held_src)):
            by_depth = {}
            for d in depths:
                eps, ok = run([maker.passkey(src, target, rng, template=0, digits=5, depth=d) for _ in range(args.eval_trials)])
                by_depth[f"{int(d * 100)}"] = sum(ok) / len(ok)
                all_ok.setdefault(f"{int(d * 100)}", []).extend(ok)
                all_eps += eps
            passkey[fname] = {"by_depth_percent": by_depth, "mean": sum(by_depth.values()) / len(by_depth)}
            log(f"passkey {fname}: {by_depth}")
        lens = [len(e.ids) for e in all_eps]
        results["passkey"] = {"template": 0, "digits": 5, "trials_per_depth": args.eval_trials,
                              "prompt_plus_answer_tokens": [min(lens), max(lens)], **passkey,
                              "both_fillers_by_depth": {d: {"accuracy": sum(v) / len(v), "n": len(v),
                                                            "wilson95": wilson(sum(v), len(v))}
                                                        for d, v in all_ok.items()}}

        def family(name, make, n=2 if args.smoke else 100):
            eps, ok = run([make() for _ in range(n)])
            acc = sum(ok) / len(ok)
            log(f"{name}: {acc:.3f}")
            return {"accuracy": acc, "n": n, "wilson95": wilson(sum(ok), n),
                    "tokens": [min(len(e.ids) for e in eps), max(len(e.ids) for e in eps)]}

        results["kvlist_train_family"] = family("kvlist", lambda: maker.kvlist(target, rng, digits=5))
        results["multikey_train_family"] = family("multikey", lambda: maker.multikey(held_src, target, rng, n_needles=4, digits=5))
        results["vault_heldout_family"] = family("vault (held-out format)", lambda: maker.vault(held_src, target, rng))
        results["vault_heldout_family_grass"] = family("vault grass", lambda: maker.vault(grass, target, rng))
        results["passkey_templates_1_2_prose"] = family(
            "passkey templates 1-2", lambda: maker.passkey(held_src, target, rng, template=rng.choice([1, 2]), digits=5))

        # Cross-check: HF generation with the KV cache reproduces the teacher-forced verdicts.
        agree, checked = 0, 0
        for e in all_eps[::22][:10]:
            prompt = e.ids[:-e.answer_len]
            gen = greedy_with_cache(model, prompt, e.answer_len, device)
            tf = teacher_forced_exact(model, [e], device)[0]
            agree += int((gen == e.ids[-e.answer_len:]) == tf)
            checked += 1
        results["cache_generate_agrees_with_teacher_forced"] = f"{agree}/{checked}"
        log(f"cache vs teacher-forced agreement {agree}/{checked}")
    except Exception as exc:  # noqa: BLE001 - keep what was measured, still write golden
        import traceback
        traceback.print_exc()
        results["error"] = repr(exc)
    (args.out / "eval_hf.json").write_text(json.dumps(results, indent=2) + "\n")
    model = None  # free GPU memory before the CPU golden pass

    # 6. golden (CPU, fp32, eager) ------------------------------------------
    write_golden(args, tok, hflat)
    if args.export:
        export(args.out, args.export)
    log("done")


def export(model_dir: Path, dest: Path) -> None:
    """Device calls return at most 8 files of < 16 MiB: the shards go as they are,
    everything else (configs, eval, golden) in one tar."""
    import tarfile
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.glob("*.safetensors"):
        shutil.copyfile(f, dest / f.name)
    with tarfile.open(dest / "bundle.tgz", "w:gz") as tar:
        for f in sorted(model_dir.iterdir()):
            if f.suffix != ".safetensors":
                tar.add(f, arcname=f"models/tiny/{f.name}")
        golden = Path("tests/golden/tiny")
        if golden.exists():
            tar.add(golden, arcname="tests/golden/tiny")
    log(f"exported to {dest}")


@torch.no_grad()
def write_golden(args, tok, hflat) -> None:
    maker = E.EpisodeMaker(lambda s: tok.encode(s, add_special_tokens=False).ids, BOS, EOS,
                           tok.token_to_id("Ċ"), decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    grass = E.RepeatedLine(E.GRASS_LINE, maker.enc)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = load_model(args.out, torch.float32, "eager", "cpu")
    # The fp16-KV reference (keys and values rounded to fp16, what kvslim's cache stores) is made
    # by training/golden_fp16kv.py after this: it patches the eager attention function itself,
    # because a function registered under a new name gets no causal mask in transformers 5.
    gdir = args.golden
    gdir.mkdir(parents=True, exist_ok=True)
    n_last = 8
    windows = []
    for n, start in ((64, 1000), (512, 5000), (2048, 20000)):
        ids = [BOS] + hflat[start:start + n - 1].tolist()
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0].float()  # [n, vocab]
        sel = logits[-n_last:].contiguous().numpy().astype("<f4")
        fname = f"window_{n}.logits.f32"
        sel.tofile(gdir / fname)
        entry = {"name": f"window_{n}", "n_tokens": n, "heldout_token_offset": start,
                 "input_ids": ids, "logit_positions": list(range(n - n_last, n)),
                 "logits_file": fname, "logits_shape": [n_last, int(logits.size(-1))],
                 "argmax_all_positions": logits.argmax(-1).tolist()}
        windows.append(entry)
    prompts = []
    rng = random.Random(99)
    pk = maker.passkey(grass, 200, rng, template=0, digits=5, depth=0.5)
    pk_text = pk.text[:-len(" " + pk.answer)]
    for text in ("The grass is green. The sky is blue. The sun is yellow.", pk_text):
        ids = tok.encode(text, add_special_tokens=True).ids
        cont = greedy_with_cache(model, ids, 32, "cpu")
        # Same tokens without the cache (full recompute each step) as a self-check.
        seq = list(ids)
        for _ in range(32):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(ids):] == cont, "cached and uncached greedy decoding disagree"
        prompts.append({"text": text, "input_ids": ids, "greedy_new_ids": cont,
                        "greedy_new_text": tok.decode(cont, skip_special_tokens=False)})
    golden = {
        "format": "see tests/golden/README.md",
        "model_dir": "models/tiny", "compute": "HF transformers, weights bf16 upcast to fp32, eager attention, CPU",
        "logits_encoding": "little-endian float32, row-major [len(logit_positions), vocab]",
        "windows": windows,
        "greedy": {"n_new": 32, "eos_is_not_special": True, "cases": prompts},
    }
    (gdir / "golden.json").write_text(json.dumps(golden) + "\n")
    log(f"golden written to {gdir}: greedy passkey continuation {prompts[1]['greedy_new_text']!r} (answer {pk.answer})")


if __name__ == "__main__":
    main()
