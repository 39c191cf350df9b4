"""A decode step of one attention layer through kvslim's Python Cache on the CPU, two ways, in one
run: attend(probs=True) then observe_attention(probs) -- what kvslim.hf did until stop 46 --
against attend_and_observe (what it does now). Prints ms per step and the ratio for each cache.

  PYTHONPATH=build/python python3 bench/python/layer_step.py [--context 4096] [--steps 150]

One layer of Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), batch 1: a
prompt of --context tokens, then one token per step. Each way runs four times, alternating; the
second-best time is reported (this machine's other work spreads the others)."""
import argparse
import time

import numpy as np

import kvslim

B, HQ, HKV, D = 1, 32, 8, 128


def one_run(fields, context, steps, one_call, seed=0):
    rng = np.random.default_rng(seed)
    cache = kvslim.Cache(kvslim.Config(**fields))
    observes = cache.needs()["attention"]

    def step(s, first):
        k = rng.standard_normal((B, HKV, s, D), dtype=np.float32)
        v = rng.standard_normal((B, HKV, s, D), dtype=np.float32)
        q = rng.standard_normal((B, s, HQ, D), dtype=np.float32)
        pos = np.arange(first, first + s, dtype=np.int64)
        cache.append(k, v, pos)
        if one_call:
            cache.attend_and_observe(q, pos)
        else:
            out, probs = cache.attend(q, pos, probs=observes)
            if observes:
                cache.observe_attention(probs, pos)

    step(16, 0)  # a short prompt first: the rest of the context arrives as one call
    step(context - 16, 16)
    for i in range(3):
        step(1, context + i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(1, context + 3 + i)
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args()
    budget = a.context // 4
    caches = [("h2o 25 % (fp16 slots)", dict(method="h2o", h2o_budget=budget)),
              ("h2o 25 % over kivi", dict(method="h2o", h2o_budget=budget, storage="kivi")),
              ("pyramidkv 25 % over kivi", dict(method="pyramidkv", pyramidkv_budget=budget, storage="kivi")),
              ("zipcache (attention saliency)", dict(method="zipcache", zipcache_saliency="attention_normalized"))]
    print(f"layer_step: batch {B}, {HQ}/{HKV} heads x {D}, context {a.context}, {a.steps} decode steps; "
          f"ms per step (second best of 4), attend + observe_attention vs attend_and_observe")
    for name, fields in caches:
        two, one = [], []
        for r in range(4):
            two.append(one_run(fields, a.context, a.steps, False, r))
            one.append(one_run(fields, a.context, a.steps, True, r))
        t, o = sorted(two)[1], sorted(one)[1]
        print(f"  {name:30s} {t:7.3f}  {o:7.3f}  {t / o:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
