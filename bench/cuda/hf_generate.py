#!/usr/bin/env python3
"""HF transformers generate on the GPU: DynamicCache and StaticCache (SDPA) against kvslim.hf
caches whose keys and values stay in GPU memory (Config(device="cuda")), and one kvslim CPU cache
(the old path: every step's K/V copied to the host), in one run.

For each model and batch x context: prefill time (generate of 1 token), decode tokens/s per
sequence ((new - 1) tokens after the first, from a second generate of `new` tokens), the cache's
K/V bytes (DynamicCache/StaticCache: its tensors; kvslim: resident_bytes(), its own device
allocations), torch's peak allocated memory, and the greedy tokens' agreement with DynamicCache.

    python3 bench/cuda/hf_generate.py --out DIR [--shapes 1x32768,8x32768] [--new-tokens 64]

Models: models/tiny (bf16, a prompt of --tiny-prompt tokens of its held-out text) and a random-
weight model with Llama-3-8B's attention and FFN shape (hidden 4096, 32/8 heads x 128, FFN 14336,
--layers layers, random token ids).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def sync():
    torch.cuda.synchronize()


def file_logger(out: Path, name: str):
    """A log(line) that prints each line and rewrites out/name with every line so far (a run cut
    short keeps what it wrote)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)
        (out / name).write_text("\n".join(lines) + "\n")

    return log


def kv_tensor_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_figures(rec, cache, seq, reference):
    """A finished run's memory (torch's peak plus kvslim's own device allocations), K/V bytes,
    greedy tokens and their agreement with the reference run's."""
    rec["torch_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    own = hasattr(cache, "resident_bytes")  # kvslim: its K/V are its own device allocations, not torch's
    rec["kv_bytes"] = int(cache.resident_bytes()) if own else kv_tensor_bytes(cache)
    if own:  # of which in GPU memory (the rest: host-side metadata, e.g. an eviction core's scores)
        stats = [s for s in cache.stats() if s is not None]
        rec["kv_device_bytes"] = int(sum(s["figures"].get("device_bytes", 0) for s in stats))
        # The decisions the host core still makes (a prompt's window, squeeze's adopted budgets):
        # host wall ms by phase, summed over layers (wait: the model's queued kernels).
        phases = ("wait", "probs", "pull", "core", "flush_push")
        if any("trims_on_device" in s["figures"] for s in stats):  # squeeze's budgets cut on the device
            rec["trims_on_device"] = int(sum(s["figures"].get("trims_on_device", 0) for s in stats))
            rec["device_trim_ms"] = round(sum(s["figures"].get("device_trim_ms", 0.0) for s in stats), 1)
        if any(s["figures"].get("prompts_on_device", 0) for s in stats):  # prompts scored and cut on the device
            rec["prompts_on_device"] = int(sum(s["figures"].get("prompts_on_device", 0) for s in stats))
            rec["device_prompt_ms"] = round(sum(s["figures"].get("device_prompt_ms", 0.0) for s in stats), 1)
        if any("host_decisions" in s["figures"] for s in stats):
            rec["host_decision_ms"] = {p: round(sum(s["figures"].get(f"host_decision_{p}_ms", 0.0) for s in stats), 1)
                                       for p in phases}
    # Peak device memory of the run: torch's peak, plus kvslim's own allocations (at their largest
    # at the end of generate: the caches only grow).
    rec["peak_gb"] = round(rec["torch_peak_gb"] + (rec["kv_device_bytes"] / 1e9 if own else 0.0), 3)
    rec["tokens"] = seq[0].tolist()
    if reference is not None:
        ref = reference["tokens"]
        rec["agreement_with_dynamic"] = round(sum(a == b for a, b in zip(rec["tokens"], ref)) / len(ref), 3)


def report(rec, label, log, line):
    """Frees the run's memory and logs its line (line(agree) -> text) or its failure."""
    gc.collect()
    torch.cuda.empty_cache()
    if "error" in rec:
        log(f"  {label:28s} FAIL {rec['error']}")
    else:
        agree = f"  agree {rec['agreement_with_dynamic']:.2f}" if "agreement_with_dynamic" in rec else ""
        log(f"  {label:28s} {line(agree)}")
        if rec.get("host_decision_ms"):
            log(f"  {'':28s} host decisions, ms summed over layers: " +
                ", ".join(f"{k} {v}" for k, v in rec["host_decision_ms"].items()))
        if rec.get("trims_on_device"):
            log(f"  {'':28s} budgets trimmed on the device: {rec['trims_on_device']} layers, {rec['device_trim_ms']} ms")
        if rec.get("prompts_on_device"):
            log(f"  {'':28s} prompts scored and cut on the device: {rec['prompts_on_device']} layers, "
                f"{rec['device_prompt_ms']} ms (waits for the model's queued kernels included)")
    return rec


def tiny_model(dtype, prompt_tokens: int):
    """(model, tokenizer, ids [1, prompt_tokens]): models/tiny on the GPU with SDPA, prompted with
    its held-out text (repeated to length)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    d = ROOT / "models/tiny"
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, attn_implementation="sdpa").cuda().eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    ids = tok((d / "heldout_sample.txt").read_text())["input_ids"]
    while len(ids) < prompt_tokens:
        ids = ids + ids
    return model, tok, torch.tensor([ids[:prompt_tokens]], device="cuda")


def run_generate(model, ids, new, make_cache, static=False):
    """(seconds, sequences [B, new], cache) of one greedy generate."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                  pad_token_id=0, eos_token_id=None)
    cache = make_cache() if make_cache else None
    if cache is not None:
        kwargs["past_key_values"] = cache
    if static:
        kwargs["cache_implementation"] = "static"
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    sync()
    dt = time.perf_counter() - t0
    return dt, out.sequences[:, ids.shape[1]:], (cache if cache is not None else out.past_key_values)


def profile_steps(model, ids, make_cache, static, steps=8):
    """(prefill seconds, ms per decode step of model forward calls, ms per step under
    torch.profiler, GPU kernel ms per step): the prompt's forward call, then `steps` one-token
    forward calls timed alone (no generate machinery; best of 3 rounds),
    then `steps` more under torch.profiler (CUPTI sees every kernel of the process, kvslim's too):
    what is not kernel time is Python, launches and synchronisation."""
    from torch.profiler import ProfilerActivity, profile
    if static:
        from transformers import StaticCache
        # 2 warm-up steps, 3 timed rounds and a profiled round of `steps` each.
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4 * steps + 3)
    else:
        cache = make_cache() if make_cache else None
        if cache is None:
            from transformers import DynamicCache
            cache = DynamicCache(config=model.config)
    B, T = ids.shape
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = r.logits[:, -1:].argmax(-1)
        sync()
        prefill = time.perf_counter() - t0
        pos = T

        def step():
            nonlocal r, nxt, pos
            r = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                      cache_position=torch.tensor([pos], device="cuda"))
            nxt = r.logits[:, -1:].argmax(-1)
            pos += 1

        for _ in range(2):  # warm-up steps
            step()
        plain = float("inf")
        for _ in range(3):  # best of 3 rounds: the host's Python work varies between rounds
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            plain = min(plain, time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = time.perf_counter() - t0
    kernel_ms, top = kernel_table(prof, steps)
    return prefill, 1000 * plain / steps, 1000 * wall / steps, kernel_ms, top


def kernel_table(prof, steps):
    """(GPU kernel ms per step, kvslim's own kernels by name in ms per step) of a torch.profiler
    run over `steps` steps: attend, merge, probs, append, the decode eviction -- what eviction
    costs beside the attention."""
    events = [(e.key, getattr(e, "self_device_time_total", 0.0)) for e in prof.key_averages()]
    kernel_us = sum(t for _, t in events)
    top = {k[:80]: round(t / 1000 / steps, 4) for k, t in sorted(events, key=lambda e: -e[1]) if t > 0 and "kvslim" in k}
    return kernel_us / 1000 / steps, top


def measure(model, ids, new, label, make_cache=None, static=False, reference=None, log=print):
    rec = {"variant": label, "batch": int(ids.shape[0]), "context": int(ids.shape[1]), "new_tokens": new}
    try:
        # Warm-up: kernels, allocator; for StaticCache at the measured shape, since transformers
        # compiles its decode step (torch.compile) and a new cache length recompiles.
        if static:
            run_generate(model, ids, new, make_cache, static)
        else:
            run_generate(model, ids[:, :128], 4, make_cache, static)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t_one, _, c1 = run_generate(model, ids, 1, make_cache, static)  # the prompt and one token
        del c1
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        t_all, seq, cache = run_generate(model, ids, new, make_cache, static)
        rec["total_s"] = round(t_all, 4)
        cache_figures(rec, cache, seq, reference)
        del cache
        gc.collect()
        prefill_s, forward_ms, step_ms, kernel_ms, rec["top_kernels_ms"] = profile_steps(model, ids, make_cache, static)
        rec["prefill_s"] = round(prefill_s, 4)
        # generate's decode: the time of `new` tokens minus that of one (the prompt's call).
        decode_s = max(t_all - t_one, 1e-9)
        rec["decode_tok_s"] = round((new - 1) / decode_s, 2)  # per sequence
        rec["decode_ms_per_step"] = round(1000 * decode_s / (new - 1), 3)
        rec["forward_step_ms"] = round(forward_ms, 3)
        rec["profiled_step_ms"] = round(step_ms, 3)
        rec["kernel_ms_per_step"] = round(kernel_ms, 3)
        rec["gpu_busy"] = round(kernel_ms / step_ms, 3)
    except Exception as e:  # report and go on
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    return report(rec, label, log, lambda agree: (
        f"prefill {rec['prefill_s']:8.3f} s  forward {rec['forward_step_ms']:7.2f} ms/step  "
        f"generate {rec['decode_tok_s']:8.2f} tok/s/seq ({rec['decode_ms_per_step']:7.2f} ms/step)  K/V {rec['kv_bytes'] / 1e9:8.3f} GB  "
        f"peak {rec['peak_gb']:7.2f} GB{agree}  profiled {rec['profiled_step_ms']:.2f} ms/step, "
        f"kernels {rec['kernel_ms_per_step']:.2f} ms ({100 * rec['gpu_busy']:.0f} % busy)"))


def measure_graph(model, ids, new, label, make_cache, reference=None, log=print, rounds=3, steps=16):
    """A kvslim cache decoded by kvslim.hf.GraphDecoder (one CUDA graph replay per step): the time
    of generate's decode steps with the eager first step and the capture included
    (decode_ms_per_step, timed from the prompt's end), and the steady replay time per step (best of
    `rounds` x `steps` steps timed alone: graph_step_ms)."""
    import kvslim
    import kvslim.hf
    rec = {"variant": label, "batch": int(ids.shape[0]), "context": int(ids.shape[1]), "new_tokens": new}
    T = ids.shape[1]
    try:
        try:  # warm-up (an eviction cache below its budget refuses the capture: its eager step warmed)
            kvslim.hf.GraphDecoder(model, make_cache(), max_tokens=136).generate(ids[:, :128], 4)
        except kvslim.InputError:
            pass
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cache = make_cache()
        dec = kvslim.hf.GraphDecoder(model, cache, max_tokens=T + new + (rounds + 1) * steps)  # + the profiled steps
        # GraphDecoder.generate's work, timed at the prompt's end: the prefill, then new - 1 steps
        # (the eager one, the capture, the replays). Timed in one run: a decode time taken as the
        # difference of two runs' totals carried the prefill's own variation (1 % of a 13 s
        # prefill is 2 ms per step over 64 steps).
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        nxt = logits[:, -1:].argmax(-1)
        sync()
        t_one = time.perf_counter() - t0
        out = [nxt]
        t0 = time.perf_counter()
        for _ in range(new - 1):
            nxt = dec.step(nxt)[:, -1:].argmax(-1)
            out.append(nxt)
        sync()
        decode_s = max(time.perf_counter() - t0, 1e-9)
        seq = torch.cat(out, dim=1)
        nxt = seq[:, -1:]
        best = float("inf")
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = dec.step(nxt).argmax(-1)
            sync()
            best = min(best, time.perf_counter() - t0)
        rec["graph_step_ms"] = round(1000 * best / steps, 3)
        # The replayed steps' kernels (CUPTI reports a graph's kernel nodes too): what the decode
        # eviction costs inside the step that generate really runs.
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                nxt = dec.step(nxt).argmax(-1)
            sync()
        rec["replay_kernel_ms_per_step"], rec["replay_top_kernels_ms"] = kernel_table(prof, steps)
        rec["replay_kernel_ms_per_step"] = round(rec["replay_kernel_ms_per_step"], 3)
        log(f"  {label}: replayed step's kvslim kernels, ms/step: {rec['replay_top_kernels_ms']}")
        rec["graph_nodes_kvslim"] = int(dec._step_graph.nodes)
        rec["eager_steps"] = int(dec.eager_steps)  # steps a cache decided on the host (not replayed)
        cache_figures(rec, cache, seq, reference)
        rec["prefill_s"] = round(t_one, 4)
        rec["decode_tok_s"] = round((new - 1) / decode_s, 2)
        rec["decode_ms_per_step"] = round(1000 * decode_s / (new - 1), 3)
        del dec, cache
    except Exception as e:  # report and go on
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    return report(rec, label, log, lambda agree: (
        f"prefill {rec['prefill_s']:8.3f} s  generate {rec['decode_tok_s']:8.2f} tok/s/seq "
        f"({rec['decode_ms_per_step']:7.2f} ms/step, eager step + capture included)  replay "
        f"{rec['graph_step_ms']:7.3f} ms/step  K/V {rec['kv_bytes'] / 1e9:8.3f} GB  peak {rec['peak_gb']:7.2f} GB{agree}"
        f"  replay kernels {rec['replay_kernel_ms_per_step']:.3f} ms/step"
        + (f"  eager steps {rec['eager_steps']}" if rec.get("eager_steps") else "")))


ONLY = []  # --only
NO_CUDNN = "DynamicCache (sdpa, no cuDNN)"


def variants():
    """(label, Config fields or None for transformers' caches, static: True for StaticCache,
    "graph" for a kvslim cache decoded by GraphDecoder)."""
    return [
        ("DynamicCache (sdpa)", None, False),
        # The same with torch's cuDNN attention backend off: on the H200 (torch 2.11) SDPA picks
        # cuDNN for a decode step, which builds a new plan for every cache length it has not seen
        # (~5 ms of host time per layer call: 50-80 ms per step of generate); with cuDNN off SDPA
        # takes its flash/efficient kernels. The better of the two is the baseline to beat.
        (NO_CUDNN, None, False),
        ("StaticCache (sdpa)", None, True),
        ("kvslim full (cuda)", {"method": "full", "device": "cuda"}, False),
        ("kvslim kivi2 (cuda)", {"method": "kivi", "kivi_bits": 2, "kivi_group_size": 32, "device": "cuda"}, False),
        ("kvslim kivi4 (cuda)", {"method": "kivi", "kivi_bits": 4, "kivi_group_size": 32, "device": "cuda"}, False),
        # h2o keeping 25 % of the prompt's tokens per head (the budget is set from the prompt).
        ("kvslim h2o 25% (cuda)", {"method": "h2o", "h2o_budget": 0.25, "device": "cuda"}, False),
        # zipcache (the other seed method) at its defaults.
        ("kvslim zipcache (cuda)", {"method": "zipcache", "device": "cuda"}, False),
        # The same caches decoded by kvslim.hf.GraphDecoder: one CUDA graph replay per step.
        ("kvslim full (cuda, graph)", {"method": "full", "device": "cuda"}, "graph"),
        ("kvslim kivi2 (cuda, graph)", {"method": "kivi", "kivi_bits": 2, "kivi_group_size": 32, "device": "cuda"}, "graph"),
        ("kvslim kivi4 (cuda, graph)", {"method": "kivi", "kivi_bits": 4, "kivi_group_size": 32, "device": "cuda"}, "graph"),
        ("kvslim h2o 25% (cuda, graph)", {"method": "h2o", "h2o_budget": 0.25, "device": "cuda"}, "graph"),
        ("kvslim zipcache (cuda, graph)", {"method": "zipcache", "device": "cuda"}, "graph"),
        # Keys at 4 bits, values at 2, groups of 128 rows (issue 27: the keys need the bits).
        ("kvslim kivi K4V2 g128 (cuda graph)", {"method": "kivi", "kivi_bits": 4, "kivi_value_bits": 2,
                                                "kivi_group_size": 128, "device": "cuda"}, "graph"),
        # squeeze (the seed method): 25 % of the prompt's tokens per head on average, moved between
        # layers by its schedule.
        ("kvslim squeeze 25% (cuda, graph)", {"method": "squeeze", "squeeze_budget": 0.25, "device": "cuda"}, "graph"),
        # Policies over compressed storage (the two seed axes composed): h2o / squeeze keeping 25 % of
        # the prompt's tokens, their rows as kivi codes (keys 4 bits, values 2, groups of 128); a
        # decode step decided by the device kernel, eager or replayed as a graph (the compression
        # between two replays).
        ("kvslim h2o 25% over kivi K4V2 g128 (cuda)", {"method": "h2o", "h2o_budget": 0.25, "storage": "kivi",
                                                       "kivi_bits": 4, "kivi_value_bits": 2, "kivi_group_size": 128,
                                                       "device": "cuda"}, False),
        ("kvslim squeeze 25% over kivi K4V2 g128 (cuda)", {"method": "squeeze", "squeeze_budget": 0.25,
                                                           "storage": "kivi", "kivi_bits": 4, "kivi_value_bits": 2,
                                                           "kivi_group_size": 128, "device": "cuda"}, False),
        ("kvslim h2o 25% over kivi K4V2 g128 (cuda graph)", {"method": "h2o", "h2o_budget": 0.25, "storage": "kivi",
                                                             "kivi_bits": 4, "kivi_value_bits": 2,
                                                             "kivi_group_size": 128, "device": "cuda"}, "graph"),
        ("kvslim squeeze 25% over kivi K4V2 g128 (cuda graph)", {"method": "squeeze", "squeeze_budget": 0.25,
                                                                 "storage": "kivi", "kivi_bits": 4,
                                                                 "kivi_value_bits": 2, "kivi_group_size": 128,
                                                                 "device": "cuda"}, "graph"),
        # StreamingLLM keeping 25 % (its sinks and the newest tokens) over the same codes: each
        # step's row admitted on the device, replayed.
        ("kvslim streaming 25% over kivi K4V2 g128 (cuda graph)", {"method": "streaming", "streaming_budget": 0.25,
                                                                   "storage": "kivi", "kivi_bits": 4,
                                                                   "kivi_value_bits": 2, "kivi_group_size": 128,
                                                                   "device": "cuda"}, "graph"),
        # Both seeds in one cache on the device: squeeze's budgets over zipcache's sets (the
        # defaults: half of each 128-row group's keys at 4 bits, the rest at 2, values at 4), and
        # h2o over the same storage.
        ("kvslim h2o 25% over zipcache (cuda graph)", {"method": "h2o", "h2o_budget": 0.25, "storage": "zipcache",
                                                       "device": "cuda"}, "graph"),
        ("kvslim squeeze 25% over zipcache (cuda graph)", {"method": "squeeze", "squeeze_budget": 0.25,
                                                           "storage": "zipcache", "device": "cuda"}, "graph"),
    ]


def bench_model(model, ids, new, log, cpu_reference=False, with_static=True):
    import transformers

    import kvslim
    import kvslim.hf
    recs = []
    ref = None
    for label, fields, static in variants():
        if static is True and not with_static:
            continue
        if ONLY and not any(o in label for o in ONLY):
            continue
        if fields is None:
            # DynamicCache passed in, as the kvslim caches are (generate's own choice of cache
            # measured 85 ms per step whatever the shape).
            make = None if static else (lambda: transformers.DynamicCache(config=model.config))
            cudnn = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(cudnn and label != NO_CUDNN)
            try:
                r = measure(model, ids, new, label, make_cache=make, static=static, reference=ref, log=log)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            if ref is None and "error" not in r:
                ref = r
            recs.append(r)
            continue
        kvslim.hf.prepare(model)
        fields = dict(fields)
        for budget in ("h2o_budget", "squeeze_budget", "streaming_budget"):
            if isinstance(fields.get(budget), float):  # a share of the prompt's tokens
                fields[budget] = int(fields[budget] * ids.shape[1])
        cfg = kvslim.Config(**fields)
        make = lambda: kvslim.hf.KVSlimCache(model, cfg)
        if static == "graph":
            recs.append(measure_graph(model, ids, new, label, make, reference=ref, log=log))
        else:
            recs.append(measure(model, ids, new, label, make, reference=ref, log=log))
        kvslim.hf.restore(model)
    if cpu_reference:
        kvslim.hf.prepare(model)
        cfg = kvslim.Config(method="kivi", kivi_bits=2, kivi_group_size=32)
        recs.append(measure(model, ids, new, "kvslim kivi2 (cpu cache)", lambda: kvslim.hf.KVSlimCache(model, cfg),
                            reference=ref, log=log))
        kvslim.hf.restore(model)
    return recs


def tiny(args, log):
    model, _, ids = tiny_model(torch.bfloat16, args.tiny_prompt)
    c = model.config
    log(f"== models/tiny: {c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads x "
        f"{c.hidden_size // c.num_attention_heads}, bf16, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens")
    recs = bench_model(model, ids, args.new_tokens, log, cpu_reference=True)
    for r in recs:
        r["model"] = "models/tiny"
    del model
    return recs


def llama8b_model(layers: int):
    """A random-weight bf16 model of Llama-3-8B's attention and FFN shape with `layers` layers, on
    the GPU, attending with SDPA (shared by hf_profile.py and hf_max_batch.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=262144,
                      rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    return model


def llama8b_shape(args, log):
    model = llama8b_model(args.layers)
    cfg = model.config
    recs = []
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.lower().split("x"))
        log(f"== Llama-3-8B shape, {args.layers} layers, random weights, bf16: batch {b} x {t} tokens, "
            f"{args.new_tokens} new tokens")
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(10, cfg.vocab_size, (b, t), device="cuda", generator=g)
        # StaticCache at the first shapes only: transformers compiles its decode step over the
        # whole preallocated length, which costs minutes of the device's time at 128k.
        for r in bench_model(model, ids, args.new_tokens, log, with_static=b * t <= args.static_limit):
            r["model"] = f"llama3-8b-shape-{args.layers}L"
            recs.append(r)
    del model
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tiny-prompt", type=int, default=1900)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="1x32768,8x32768")
    ap.add_argument("--skip", default="", help="comma list of: tiny,llama")
    ap.add_argument("--static-limit", type=int, default=8 * 32768, help="StaticCache only up to batch x context")
    ap.add_argument("--only", default="", help="comma list: run only the caches whose label contains one of these")
    args = ap.parse_args()
    ONLY[:] = list(filter(None, args.only.split(",")))
    out = Path(args.out)
    log = file_logger(out, "hf_generate.txt")

    import transformers

    import kvslim
    log(f"hf_generate: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, kvslim {kvslim.__version__}; decode tok/s is per sequence")
    recs = []
    skip = set(filter(None, args.skip.split(",")))
    if "tiny" not in skip:
        recs += tiny(args, log)
    if "llama" not in skip:
        recs += llama8b_shape(args, log)
    for r in recs:
        r.pop("tokens", None)
    (out / "hf_generate.json").write_text(json.dumps(recs, indent=1))
    return 1 if any("error" in r for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
