#!/usr/bin/env python3
"""Where a decode step's time goes on the host: HF transformers' own Python, kvslim's Python,
kvslim's C++ calls, torch's dispatch, and waits on the GPU.

For each shape and cache (DynamicCache, kvslim device caches) on the Llama-3-8B-shaped model of
hf_generate.py: the prompt, 3 warm-up one-token steps, then
  * host ms/step: from calling the model until it returns (no synchronisation inside the step
    unless the code under test synchronises), and wall ms/step (until the GPU is done too), over
    8 steps each started on an idle GPU;
  * cProfile of 8 steps: the functions with most own time (Python, and C++ calls as builtins);
  * torch.profiler's CPU view of 8 steps: the torch ops with most own CPU time.
    python3 bench/cuda/hf_profile.py --out DIR [--shapes 1x32768,8x32768] [--only kivi2]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_generate import file_logger, llama8b_model, sync  # noqa: E402


def caches(model, T):
    import transformers

    import kvslim
    import kvslim.hf
    yield "DynamicCache", None, lambda: transformers.DynamicCache(config=model.config)
    for label, fields in (("kvslim kivi2", dict(method="kivi", kivi_bits=2, kivi_group_size=32, device="cuda")),
                          ("kvslim full", dict(method="full", device="cuda")),
                          ("kvslim h2o 25%", dict(method="h2o", h2o_budget=T // 4, device="cuda"))):
        cfg = kvslim.Config(**fields)
        yield label, True, (lambda cfg=cfg: kvslim.hf.KVSlimCache(model, cfg))


def profile_one(model, ids, make, log, steps=8):
    B, T = ids.shape
    cache = make()
    with torch.no_grad():
        r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = r.logits[:, -1:].argmax(-1)
        pos = [T]
        pos_dev = torch.tensor([T], device="cuda")

        def step():
            nonlocal r, nxt
            r = model(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=pos_dev)
            nxt = r.logits[:, -1:].argmax(-1)
            pos[0] += 1
            pos_dev.add_(1)

        for _ in range(3):
            step()
        host = wall = 0.0
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host += t1 - t0
            wall += t2 - t0
        log(f"    host {1000 * host / steps:7.2f} ms/step (model() returns), wall {1000 * wall / steps:7.2f} ms/step "
            f"(GPU done), each step from an idle GPU")
        # back to back, as generate runs them (the host may run ahead of the GPU)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        log(f"    back to back {1000 * (time.perf_counter() - t0) / steps:7.2f} ms/step")
        prof = cProfile.Profile()
        sync()
        prof.enable()
        for _ in range(steps):
            step()
        sync()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        log("    cProfile, 8 steps, by own time:\n" + "\n".join("      " + l for l in s.getvalue().splitlines()[6:]))
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                step()
            sync()
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        log("    torch.profiler CPU, 8 steps:\n" + "\n".join("      " + l for l in table.splitlines()))
    del cache, r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="1x32768,8x32768")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    log = file_logger(Path(args.out), "hf_profile.txt")

    import kvslim.hf
    model = llama8b_model(args.layers)
    cfg = model.config
    only = list(filter(None, args.only.split(",")))
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.lower().split("x"))
        ids = torch.randint(10, cfg.vocab_size, (b, t), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        for label, ours, make in caches(model, t):
            if only and not any(o in label for o in only):
                continue
            log(f"== {args.layers} layers, batch {b} x {t}: {label}")
            if ours:
                kvslim.hf.prepare(model)
            try:
                profile_one(model, ids, make, log)
            except Exception as e:  # report and go on
                log(f"    FAIL {type(e).__name__}: {e}"[:400])
            if ours:
                kvslim.hf.restore(model)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
