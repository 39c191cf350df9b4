#!/usr/bin/env python3
"""The largest batch of 32k-token sequences each cache serves in a fixed memory budget (issue 25's
capacity figure), on the Llama-3-8B-shaped model of hf_generate.py.

For each cache and batch B: a prefill of B x --context random tokens in chunks of --chunk tokens
(the whole batch per chunk: a prompt's activations then scale with the chunk, not the context, so
the cache is what grows with B), then --steps one-token decode steps. The run's peak is torch's
peak allocation plus kvslim's own device allocations (kvslim's stores only grow, so their size at
the end is their peak); B fits when that peak is within --budget-gb and nothing ran out of memory.
The search doubles B from 1 until it fails, then bisects.

    python3 bench/cuda/hf_max_batch.py --out DIR [--budget-gb 100] [--context 32768] [--only kivi2]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_generate import file_logger, llama8b_model, sync  # noqa: E402


def caches(model, context):
    """(label, make_cache or None for DynamicCache, whether SDPA's cuDNN backend is off)."""
    import transformers

    import kvslim
    import kvslim.hf
    yield "DynamicCache (sdpa, no cuDNN)", (lambda: transformers.DynamicCache(config=model.config)), True
    for label, fields in (("kvslim kivi2 (cuda)", dict(method="kivi", kivi_bits=2, device="cuda")),
                          ("kvslim kivi4 (cuda)", dict(method="kivi", kivi_bits=4, device="cuda")),
                          ("kvslim h2o 25% (cuda)", dict(method="h2o", h2o_budget=context // 4, device="cuda"))):
        cfg = kvslim.Config(**fields)
        yield label, (lambda cfg=cfg: kvslim.hf.KVSlimCache(model, cfg)), False


def kvslim_device_bytes(cache) -> int:
    if not hasattr(cache, "stats"):
        return 0
    return int(sum(s["figures"].get("device_bytes", 0) for s in cache.stats() if s is not None))


def try_batch(model, make, batch, context, chunk, steps):
    """(fits-run record): peak GB (torch + kvslim), seconds, or the error that stopped it."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rec = {"batch": batch}
    cache = None
    t0 = time.perf_counter()
    try:
        g = torch.Generator(device="cuda").manual_seed(batch)
        cache = make()
        with torch.no_grad():
            for start in range(0, context, chunk):
                ids = torch.randint(10, model.config.vocab_size, (batch, min(chunk, context - start)), device="cuda",
                                    generator=g)
                r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                          cache_position=torch.arange(start, start + ids.shape[1], device="cuda"))
                del ids
            nxt = r.logits[:, -1:].argmax(-1)
            for i in range(steps):
                r = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([context + i], device="cuda"))
                nxt = r.logits[:, -1:].argmax(-1)
        sync()
        own = kvslim_device_bytes(cache)
        rec["torch_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        rec["kvslim_gb"] = round(own / 1e9, 3)
        rec["peak_gb"] = round(rec["torch_peak_gb"] + rec["kvslim_gb"], 3)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the device's memory, or kvslim's allocation
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def largest_batch(model, make, context, chunk, steps, budget_gb, limit, log):
    runs = []

    def fits(b):
        rec = try_batch(model, make, b, context, chunk, steps)
        runs.append(rec)
        ok = "error" not in rec and rec["peak_gb"] <= budget_gb
        log(f"    batch {b:4d}: " + (f"peak {rec['peak_gb']:7.2f} GB (torch {rec['torch_peak_gb']:.2f} + kvslim "
                                     f"{rec['kvslim_gb']:.2f})" if "error" not in rec else rec["error"][:100])
            + f", {rec['seconds']:.1f} s -> {'fits' if ok else 'does not fit'}")
        return ok

    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-gb", type=float, default=100.0)
    ap.add_argument("--limit", type=int, default=256, help="largest batch tried")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    out = Path(args.out)
    log = file_logger(out, "hf_max_batch.txt")
    results = []

    import kvslim.hf
    model = llama8b_model(args.layers)
    log(f"hf_max_batch: {torch.cuda.get_device_name(0)}, {args.layers}-layer Llama-3-8B shape, bf16, context "
        f"{args.context}, prefill chunks of {args.chunk}, {args.steps} decode steps, budget {args.budget_gb} GB")
    only = list(filter(None, args.only.split(",")))
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    for label, make, no_cudnn in caches(model, args.context):
        if only and not any(o in label for o in only):
            continue
        log(f"== {label}")
        ours = label.startswith("kvslim")
        if ours:
            kvslim.hf.prepare(model)
        torch.backends.cuda.enable_cudnn_sdp(cudnn and not no_cudnn)
        try:
            best, runs = largest_batch(model, make, args.context, args.chunk, args.steps, args.budget_gb, args.limit, log)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            if ours:
                kvslim.hf.restore(model)
        log(f"  largest batch at {args.context} tokens within {args.budget_gb} GB: {best}")
        results.append({"cache": label, "largest_batch": best, "runs": runs})
        (out / "hf_max_batch.json").write_text(json.dumps(results, indent=1))
    base = next((r["largest_batch"] for r in results if r["cache"].startswith("DynamicCache")), None)
    if base:
        for r in results[1:]:
            log(f"  {r['cache']:28s} {r['largest_batch'] / base:5.2f}x DynamicCache's batch")


if __name__ == "__main__":
    main()
