#!/usr/bin/env python3
"""The largest batch of 32k-token sequences each cache serves in a fixed memory budget (issue 25's
capacity figure), on the Llama-3-8B-shaped model of hf_generate.py, and the decode throughput
(tokens/s over the whole batch) at that batch.

For each cache and batch B, the cache is filled to --context tokens per sequence with random keys
and values (DynamicCache: one update per layer; kvslim: appends of --chunk tokens per layer, an
eviction cache observing random queries of each chunk's last window, so it evicts to its budget as
a chunked prefill would), then the model runs --steps one-token decode steps at batch B. A model
prefill is not what is measured: its activations depend on how a server schedules prompts (one
32k prompt in one call needs tens of GB at any batch), not on the cache, and kvslim's chunk
attention over compressed rows is the decode kernel run per query tile (a 32k x B prefill in
chunks would take hours at B = 400). The peak counted is what the decode steps hold: torch's peak
allocation, reset after the fill (so it starts from the cache's resident bytes, the weights
included), plus kvslim's own device allocations (its stores and attention workspace: they only
grow, so their size at the end is their peak). B fits when that peak is within --budget-gb and
nothing ran out of memory. The device-wide use (cudaMemGetInfo: torch's reserved pool, the CUDA
context and kvslim together) is printed beside it. The search doubles B from 1 until it fails,
then bisects.

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
    for label, fields in (("kvslim kivi2 (cuda)", dict(method="kivi", kivi_bits=2, kivi_group_size=32, device="cuda")),
                          ("kvslim kivi4 (cuda)", dict(method="kivi", kivi_bits=4, kivi_group_size=32, device="cuda")),
                          ("kvslim h2o 25% (cuda)", dict(method="h2o", h2o_budget=context // 4, device="cuda"))):
        cfg = kvslim.Config(**fields)
        yield label, (lambda cfg=cfg: kvslim.hf.KVSlimCache(model, cfg)), False


def kvslim_device_bytes(cache) -> int:
    """kvslim's device allocations for `cache`: its stores plus its attention workspace."""
    if not hasattr(cache, "stats"):
        return 0
    return int(sum(s["figures"].get("device_bytes", 0) + s["view_bytes"] for s in cache.stats() if s is not None))


def fill(model, cache, batch, context, chunk, g):
    """Every layer of `cache` holds `context` random tokens per sequence (bf16 keys and values), over
    this rank's heads when the model is tensor parallel."""
    cfg = model.config
    tp = int(getattr(model, "_tp_size", None) or 1)  # tensor parallel: this rank holds 1/tp of the heads
    hkv, hq, d = cfg.num_key_value_heads // tp, cfg.num_attention_heads // tp, cfg.head_dim
    layers = cfg.num_hidden_layers

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    if not hasattr(cache, "stats"):  # DynamicCache: the whole context in one update per layer
        for layer in range(layers):
            cache.update(rand(batch, hkv, context, d), rand(batch, hkv, context, d), layer)
        return
    for layer in cache.layers:
        state = layer.state
        layer.lazy_initialization(torch.empty(0, device="cuda", dtype=torch.bfloat16))
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            state.update(rand(batch, hkv, n, d), rand(batch, hkv, n, d), None)
            if state.wants_attention:  # an eviction cache scores the chunk's last queries, then evicts
                w = state._window(n)
                state._attend_and_observe(rand(batch, w, hq, d), state.query_positions[-w:], None)


def try_batch(model, make, batch, context, chunk, steps):
    """(fits-run record): decode peak GB (torch + kvslim), device-wide use, seconds, decode
    tokens/s over the batch, or the error that stopped it."""
    gc.collect()
    torch.cuda.empty_cache()
    rec = {"batch": batch}
    cache = None
    t0 = time.perf_counter()
    try:
        g = torch.Generator(device="cuda").manual_seed(batch)
        cache = make()
        with torch.no_grad():
            fill(model, cache, batch, context, chunk, g)
            sync()
            rec["fill_seconds"] = round(time.perf_counter() - t0, 2)
            torch.cuda.reset_peak_memory_stats()
            nxt = torch.randint(10, model.config.vocab_size, (batch, 1), device="cuda", generator=g)
            times = []
            for i in range(steps):
                t = time.perf_counter()
                r = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([context + i], device="cuda"))
                nxt = r.logits[:, -1:].argmax(-1)
                sync()
                times.append(time.perf_counter() - t)
        own = kvslim_device_bytes(cache)
        rec["torch_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        rec["kvslim_gb"] = round(own / 1e9, 3)
        rec["peak_gb"] = round(rec["torch_peak_gb"] + rec["kvslim_gb"], 3)
        free, total = torch.cuda.mem_get_info()
        rec["device_used_gb"] = round((total - free) / 1e9, 3)
        step = min(times[1:]) if len(times) > 1 else times[0]  # the first step may allocate workspace
        rec["step_ms"] = round(step * 1e3, 3)
        rec["tokens_per_s"] = round(batch / step, 1)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the device's memory, or kvslim's allocation
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def largest_batch(model, make, context, chunk, steps, budget_gb, limit, log, time_limit, agree=None):
    """The largest B that fits, and every run's record. The search stops early (and says so) once
    the cache's runs have taken `time_limit` seconds: B is then the largest that fitted so far. A
    batch whose peak, extrapolated from the last two that ran, exceeds 92 % of the GPU's memory or
    110 % of the budget is not tried (running out of memory costs more than a run, and a batch far
    over the budget cannot fit it).
    agree(flag, "min" | "max"): the decision of every rank of a tensor-parallel model (so they
    search alike); one process decides alone."""
    agree = agree or (lambda flag, _op: flag)
    physical = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 1e9
    runs, fitted = [], []  # fitted: (batch, peak GB) of the runs that ran
    began = time.perf_counter()

    def predicted(b):
        if len(fitted) < 2:
            return fitted[-1][1] * b / fitted[-1][0] if fitted else 0.0
        (b1, p1), (b2, p2) = fitted[-2:]
        return p2 + (p2 - p1) / (b2 - b1) * (b - b2)

    def fits(b):
        if agree(time.perf_counter() - began > time_limit, "max"):
            raise TimeoutError
        if predicted(b) > min(0.92 * physical, 1.1 * budget_gb):
            rec, ok = {"batch": b, "skipped": f"predicted peak {predicted(b):.1f} GB"}, False
        else:
            rec = try_batch(model, make, b, context, chunk, steps)
            ok = "error" not in rec and rec["peak_gb"] <= budget_gb
            if "error" not in rec:
                fitted.append((b, rec["peak_gb"]))
        ok = agree(ok, "min")
        runs.append(rec)
        if "skipped" in rec or "error" in rec:
            what = rec.get("skipped") or rec["error"][:100]
        else:
            what = (f"peak {rec['peak_gb']:7.2f} GB (torch {rec['torch_peak_gb']:.2f} + kvslim {rec['kvslim_gb']:.2f}; "
                    f"device {rec['device_used_gb']:.2f}), step {rec['step_ms']:.2f} ms = {rec['tokens_per_s']:.0f} tok/s")
        log(f"    batch {b:4d}: {what}" + (f", {rec['seconds']:.1f} s" if "seconds" in rec else "")
            + f" -> {'fits' if ok else 'does not fit'}")
        return ok

    lo, hi = 0, 1
    try:
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except TimeoutError:
        log(f"    search cut after {args_time(began)} s: between {lo} (fits) and {hi} (not known to fit)")
    return lo, runs


def search_caches(model, context, chunk, steps, budget_gb, limit, log, time_limit, only, save, agree=None):
    """largest_batch for each cache of caches() whose label contains one of `only` (all without),
    save(results) after each; the results: per cache its largest batch, the decode tokens/s there
    and every run."""
    import kvslim.hf
    results = []
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    for label, make, no_cudnn in caches(model, context):
        if only and not any(o in label for o in only):
            continue
        log(f"== {label}")
        ours = label.startswith("kvslim")
        if ours:
            kvslim.hf.prepare(model)
        torch.backends.cuda.enable_cudnn_sdp(cudnn and not no_cudnn)
        try:
            # An eviction cache takes chunks of its budget: each chunk's observation is decided on the host.
            size = max(chunk, context // 4) if "h2o" in label else chunk
            best, runs = largest_batch(model, make, context, size, steps, budget_gb, limit, log, time_limit, agree)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            if ours:
                kvslim.hf.restore(model)
        log(f"  largest batch at {context} tokens within {budget_gb} GB: {best}")
        at = next((r for r in runs if r["batch"] == best), {})
        results.append({"cache": label, "largest_batch": best, "tokens_per_s": at.get("tokens_per_s"), "runs": runs})
        save(results)
    return results


def args_time(began):
    return round(time.perf_counter() - began)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-gb", type=float, default=100.0)
    ap.add_argument("--limit", type=int, default=1024, help="largest batch tried")
    ap.add_argument("--only", default="")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds of search per cache")
    args = ap.parse_args()
    out = Path(args.out)
    log = file_logger(out, "hf_max_batch.txt")
    model = llama8b_model(args.layers)
    log(f"hf_max_batch: {torch.cuda.get_device_name(0)}, {args.layers}-layer Llama-3-8B shape, bf16, context "
        f"{args.context} (filled in chunks of {args.chunk}), {args.steps} decode steps, budget {args.budget_gb} GB")
    only = list(filter(None, args.only.split(",")))

    def save(results):
        (out / "hf_max_batch.json").write_text(json.dumps(results, indent=1))

    results = search_caches(model, args.context, args.chunk, args.steps, args.budget_gb, args.limit, log,
                            args.time_limit, only, save)
    base = next((r["largest_batch"] for r in results if r["cache"].startswith("DynamicCache")), None)
    if base:
        for r in results[1:]:
            ref = results[0].get("tokens_per_s") or 0
            thr = f", {r['tokens_per_s'] / ref:5.2f}x its decode tokens/s" if ref and r.get("tokens_per_s") else ""
            log(f"  {r['cache']:28s} {r['largest_batch'] / base:5.2f}x DynamicCache's batch{thr}")


if __name__ == "__main__":
    main()
