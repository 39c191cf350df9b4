#!/usr/bin/env python3
"""Issue 29's benchmark: the Llama-3-8B-shaped random model (hf_generate.py's, saved once) decoding
through kvslim.hf caches in GPU memory, tensor parallel over the GPUs of one host
(from_pretrained(..., tp_plan="auto"), NCCL), or on one GPU for the comparison.

    python3 bench/cuda/hf_tp_generate.py --save DIR [--layers 8]         # the random model, once
    python3 bench/cuda/hf_tp_generate.py --model-dir DIR --out OUT/one   # one GPU
    python3 -m torch.distributed.run --nproc-per-node 2 bench/cuda/hf_tp_generate.py --model-dir DIR --out OUT/two
    python3 bench/cuda/hf_tp_generate.py --compare OUT/one OUT/two       # the ratios, from the two runs' JSON

Per cache and batch x context: the prompt's forward call, then --steps eager one-token decode
steps (each timed, the median taken); per rank the cache's resident bytes and torch's peak; the
time spent in kvslim's own collectives (the rank gather of kvslim.distributed: squeeze's schedule,
the cross-layer board) against the step's time, for the prompt and for the decode steps; the
greedy tokens. Then the largest batch at --context per GPU within --budget-gb of each GPU
(hf_max_batch.py's fill and decode steps; the ranks decide together whether a batch fits, and a
batch whose predicted peak exceeds the GPU's memory is not tried, so no rank runs out of memory
alone while the other waits in a collective). Rank 0 writes OUT/hf_tp_generate.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_generate import file_logger, kv_tensor_bytes, llama8b_model, sync  # noqa: E402
from hf_max_batch import search_caches  # noqa: E402

TP = "WORLD_SIZE" in os.environ


def variants(context: int):
    """(label, kvslim.Config fields or None for DynamicCache, whether the decode steps are
    kvslim.hf.GraphDecoder replays: under tensor parallelism the captured step holds the model's
    NCCL all-reduces too)."""
    k4v2 = dict(kivi_bits=4, kivi_value_bits=2, kivi_group_size=128)
    return [
        ("DynamicCache (sdpa, no cuDNN)", None, False),
        ("kvslim kivi2 (cuda)", dict(method="kivi", kivi_bits=2, kivi_group_size=32), False),
        ("kvslim kivi4 (cuda)", dict(method="kivi", kivi_bits=4, kivi_group_size=32), False),
        ("kvslim kivi K4V2 g128 (cuda)", dict(method="kivi", **k4v2), False),
        ("kvslim h2o 25% (cuda)", dict(method="h2o", h2o_budget=context // 4), False),
        ("kvslim pyramidkv 25% (cuda)", dict(method="pyramidkv", pyramidkv_budget=context // 4), False),
        ("kvslim squeeze 25% (cuda)", dict(method="squeeze", squeeze_budget=context // 4), False),
        ("kvslim h2o 25% over kivi K4V2 g128 (cuda)", dict(method="h2o", h2o_budget=context // 4, storage="kivi", **k4v2),
         False),
        ("kvslim kivi K4V2 g128 (cuda graph)", dict(method="kivi", **k4v2), True),
        ("kvslim h2o 25% over kivi K4V2 g128 (cuda graph)",
         dict(method="h2o", h2o_budget=context // 4, storage="kivi", **k4v2), True),
    ]


class Collectives:
    """Wall time and calls of kvslim's rank gathers (a TensorParallel that times itself), split
    between the prompt and the decode steps by `phase`."""

    def __init__(self):
        self.seconds = {"prompt": 0.0, "decode": 0.0}
        self.calls = {"prompt": 0, "decode": 0}
        self.phase = "prompt"

    def install(self, cache):
        import kvslim.distributed as kd
        layout = cache.tp_layout
        owner = self

        class Timed(kd.TensorParallel):
            def all_gather(self, local):
                t0 = time.perf_counter()
                out = super().all_gather(local)
                owner.seconds[owner.phase] += time.perf_counter() - t0
                owner.calls[owner.phase] += 1
                return out

        cache.rank_gather = Timed(layout.group)
        cache.kvslim.set_rank_gather(cache.rank_gather)


def gather_ranks(value):
    """Every rank's `value` (rank order); [value] alone."""
    if not TP:
        return [value]
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def decode(model, cache, ids, steps, collectives, graph=False):
    """(prompt seconds, decode ms per step (median of the steps after the first; with a graph, of
    the replays after the eager step and the capture), greedy tokens)."""
    if graph:
        import kvslim.hf
        dec = kvslim.hf.GraphDecoder(model, cache, max_tokens=ids.shape[1] + steps + 1)
        step = lambda nxt, i: dec.step(nxt)
    else:
        step = lambda nxt, i: model(input_ids=nxt, past_key_values=cache, use_cache=True,
                                    cache_position=torch.tensor([ids.shape[1] + i], device=ids.device)).logits
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = r.logits[:, -1:].argmax(-1)
        sync()
        prompt_s = time.perf_counter() - t0
        collectives.phase = "decode"
        times, tokens = [], [nxt]
        for i in range(steps):
            t0 = time.perf_counter()
            nxt = step(nxt, i)[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t0)
            tokens.append(nxt)
    return prompt_s, 1000 * statistics.median(times[2 if graph else 1:]), torch.cat(tokens, 1).tolist()


def measure(model, label, fields, graph, batch, context, steps, log):
    import transformers

    import kvslim
    import kvslim.hf
    rec = {"variant": label, "batch": batch, "context": context}
    collectives = Collectives()
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(10, model.config.vocab_size, (batch, context), device="cuda", generator=g)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if fields is None:
            torch.backends.cuda.enable_cudnn_sdp(False)
            cache = transformers.DynamicCache(config=model.config)
        else:
            kvslim.hf.prepare(model)
            cache = kvslim.hf.KVSlimCache(model, kvslim.Config(device="cuda", **fields))
            if cache.tp_layout is not None:
                collectives.install(cache)
        prompt_s, step_ms, tokens = decode(model, cache, ids, steps, collectives, graph)
        rec.update(prompt_s=round(prompt_s, 3), step_ms=round(step_ms, 3), tok_s=round(1000 / step_ms, 2),
                   tokens=tokens, torch_peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3))
        rec["kv_bytes"] = kv_tensor_bytes(cache) if fields is None else int(cache.resident_bytes())
        rec["collective_s"] = {k: round(v, 4) for k, v in collectives.seconds.items()}
        rec["collective_calls"] = dict(collectives.calls)
        rec["collective_share_prompt"] = round(collectives.seconds["prompt"] / prompt_s, 4)
        rec["collective_share_decode"] = round(collectives.seconds["decode"] / (steps * step_ms / 1000), 4)
        del cache
    except Exception as e:  # report and go on (every rank fails alike: the same shapes and memory)
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        if fields is not None:
            kvslim.hf.restore(model)
    per_rank = gather_ranks({k: rec.get(k) for k in ("kv_bytes", "torch_peak_gb", "tokens", "error")})
    rec["kv_bytes_per_rank"] = [r["kv_bytes"] for r in per_rank]
    rec["torch_peak_gb_per_rank"] = [r["torch_peak_gb"] for r in per_rank]
    rec["ranks_same_tokens"] = all(r["tokens"] == per_rank[0]["tokens"] for r in per_rank)
    if "error" in rec:
        log(f"  {label:44s} FAIL {rec['error']}")
    else:
        sizes = [b for b in rec["kv_bytes_per_rank"] if b]
        spread = (max(sizes) / min(sizes) - 1) if sizes else 0.0
        log(f"  {label:44s} prompt {rec['prompt_s']:8.3f} s  step {rec['step_ms']:8.3f} ms ({rec['tok_s']:7.2f} tok/s/seq)  "
            f"K/V per rank {[round(b / 1e9, 3) for b in rec['kv_bytes_per_rank']]} GB (spread {100 * spread:.2f} %)  "
            f"collectives {100 * rec['collective_share_prompt']:.2f} % of the prompt, "
            f"{100 * rec['collective_share_decode']:.2f} % of decode  ranks' tokens {'equal' if rec['ranks_same_tokens'] else 'DIFFER'}")
    return rec


def agreed(flag: bool, op: str) -> bool:
    """`flag` decided by every rank together: "min" (all must say yes) or "max" (any)."""
    if not TP:
        return flag
    import torch.distributed as dist
    t = torch.tensor([1 if flag else 0], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return bool(t.item())


def compare(one: Path, two: Path) -> int:
    a = json.loads((one / "hf_tp_generate.json").read_text())
    b = json.loads((two / "hf_tp_generate.json").read_text())
    key = lambda r: (r["variant"], r.get("batch"), r.get("context"))
    alone = {key(r): r for r in a["runs"]}
    print(f"{b['world']} GPUs against 1 ({a['device']})")
    for r in b["runs"]:
        s = alone.get(key(r))
        if s is None or "error" in r or "error" in s:
            print(f"  {r['variant']:44s} {r.get('batch')}x{r.get('context')}: " + (r.get("error") or (s or {}).get("error") or "no 1-GPU run"))
            continue
        same = sum(x == y for row_a, row_b in zip(s["tokens"], r["tokens"]) for x, y in zip(row_a, row_b))
        total = sum(len(row) for row in s["tokens"])
        print(f"  {r['variant']:44s} {r['batch']}x{r['context']}: step {s['step_ms'] / r['step_ms']:5.2f}x faster; "
              f"K/V per GPU {max(r['kv_bytes_per_rank']) / s['kv_bytes']:.3f} of one GPU's; tokens equal to one GPU's "
              f"{same}/{total}; collectives {100 * r['collective_share_decode']:.2f} % of a decode step")
    base = {m["cache"]: m["largest_batch"] for m in a["max_batch"]}
    for m in b["max_batch"]:
        if base.get(m["cache"]):
            print(f"  largest batch, {m['cache']:44s} {m['largest_batch']} on {b['world']} GPUs against {base[m['cache']]}: "
                  f"{m['largest_batch'] / base[m['cache']]:.2f}x (target >= 1.9x)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, help="write the random model here and stop")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("ONE_GPU", "TWO_GPUS"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="8x32768,16x32768")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768, help="per sequence, for the largest batch")
    ap.add_argument("--budget-gb", type=float, default=100.0, help="per GPU, for the largest batch")
    ap.add_argument("--limit", type=int, default=1024)
    ap.add_argument("--only", default="")
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds of largest-batch search per cache")
    ap.add_argument("--no-max-batch", action="store_true")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.save:
        llama8b_model(args.layers).save_pretrained(args.save)
        return 0
    if args.model_dir is None or args.out is None:
        ap.error("--model-dir and --out (or --save, or --compare)")
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: at least 3 (a graph's eager step and capture are not timed)")
    from transformers import LlamaForCausalLM

    import kvslim
    if TP:
        model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, tp_plan="auto").eval()
    else:
        model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).cuda().eval()
    model.config._attn_implementation = "sdpa"
    rank0 = not TP or int(os.environ["RANK"]) == 0
    log = file_logger(args.out, "hf_tp_generate.txt") if rank0 else (lambda line: None)
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.cuda.get_device_name(0)
    log(f"hf_tp_generate: {world} x {device}, {args.layers}-layer Llama-3-8B shape (bf16), kvslim {kvslim.__version__}")
    only = list(filter(None, args.only.split(",")))
    result = {"world": world, "device": device, "runs": [], "max_batch": []}

    def save():
        if rank0:
            (args.out / "hf_tp_generate.json").write_text(json.dumps(result, indent=1))

    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.lower().split("x"))
        log(f"== batch {b} x {t} tokens, {args.steps} decode steps")
        for label, fields, graph in variants(t):
            if only and not any(o in label for o in only):
                continue
            result["runs"].append(measure(model, label, fields, graph, b, t, args.steps, log))
            save()
    if not args.no_max_batch:
        log(f"== largest batch at {args.context} tokens within {args.budget_gb} GB per GPU")

        def save_batches(found):
            result["max_batch"] = found
            save()

        search_caches(model, args.context, 2048, 4, args.budget_gb, args.limit, log, args.time_limit, only, save_batches,
                      agree=agreed)
    if TP:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
