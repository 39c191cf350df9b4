#!/usr/bin/env python3
"""kvslim.hf on real transformers models, in one run (the GPU machine: python/gpu_check.sh).

For each model (models/tiny when it ships weights, models/mini, the golden random models in
tests/golden/models): greedy generation with transformers' own DynamicCache and eager attention is
the reference; then every kvslim method (and the attention-/hidden-state-scored variants) generates
through kvslim.hf.KVSlimCache, greedy and with sampling, at a budget of 25 % of the prompt.
Checks: method "full" reproduces the reference token for token (greedy, and sampled with the same
seed); every other configuration generates the requested tokens; each reports resident bytes.
Writes a report (text) and a JSON file; exits 1 if a check fails.

    python3 python/tests/gpu_hf_check.py [--out python/tests/gpu_hf_check.txt] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def variants(budget: int) -> dict:
    """Every method, plus the variants fed by engine-side signals, at `budget` tokens per head.
    "full/torch" attends in torch over the view (transformers' eager arithmetic: must equal
    DynamicCache token for token); the rest use the default attention (the caches' own where the
    library has the attend contract)."""
    return {
        "full/torch": {"method": "full"},
        "full": {"method": "full"},
        "streaming": {"method": "streaming", "streaming_budget": budget},
        "h2o": {"method": "h2o", "h2o_budget": budget},
        "h2o+attention": {"method": "h2o", "h2o_budget": budget, "evict_scoring": "attention"},
        "squeeze": {"method": "squeeze", "squeeze_budget": budget},
        "squeeze+hidden+attention": {"method": "squeeze", "squeeze_budget": budget, "squeeze_signal": "hidden_cosine",
                                     "evict_scoring": "attention_normalized"},
        "pyramidkv": {"method": "pyramidkv", "pyramidkv_budget": budget},
        "zipcache": {"method": "zipcache", "zipcache_staging": 32, "zipcache_group_size": 32},
        "zipcache+attention": {"method": "zipcache", "zipcache_staging": 32, "zipcache_group_size": 32, "zipcache_saliency": "attention_normalized"},
        "kivi": {"method": "kivi", "kivi_group_size": 32, "kivi_staging": 32},
    }


def models() -> list[tuple[str, Path, list[int] | None]]:
    """(name, directory, prompt ids or None to tokenize the held-out sample)."""
    out = []
    for name in ("tiny", "mini"):
        d = ROOT / "models" / name
        if (d / "config.json").exists() and any(d.glob("*.safetensors")):
            out.append((f"models/{name}", d, None))
    for d in sorted((ROOT / "tests/golden/models").iterdir()):
        golden = json.loads((d / "golden.json").read_text())
        out.append((f"golden/{d.name}", d, golden["input_ids"]))
    return out


def prompt_ids(model_dir: Path, ids, length: int) -> list[int]:
    if ids is not None:
        return list(ids)
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return tok((model_dir / "heldout_sample.txt").read_text())["input_ids"][:length]


def dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def generate(model, ids, new_tokens, sample, cache=None, seed=1234):
    """(new token ids, the cache generate used): `cache` None lets transformers make its default
    DynamicCache (the reference)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True, pad_token_id=0)
    if cache is not None:
        kwargs["past_key_values"] = cache
    if sample:
        kwargs.update(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    else:
        kwargs.update(do_sample=False)
    torch.manual_seed(seed)
    input_ids = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out.sequences[0, len(ids):].tolist(), (cache if cache is not None else out.past_key_values)


def check_model(name, model_dir, ids, device, dtype, new_tokens=32, prompt_len=128, log=print):
    """Runs every variant on one model; returns the result records and whether all checks passed."""
    import kvslim
    import kvslim.hf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager").to(device)
    model.eval()
    ids = prompt_ids(model_dir, ids, prompt_len)
    budget = max(8, len(ids) // 4)
    log(f"== {name}: {model.config.model_type}, {model.config.num_hidden_layers} layers, prompt {len(ids)} tokens, "
        f"budget {budget} (25 %), {new_tokens} new tokens, {dtype} on {device}")

    ref_greedy, ref_cache = generate(model, ids, new_tokens, sample=False)
    ref_sampled, _ = generate(model, ids, new_tokens, sample=True)
    ref_bytes = dynamic_cache_bytes(ref_cache)
    log(f"   DynamicCache: greedy {ref_greedy[:12]}... K/V bytes {ref_bytes}")
    records, ok = [], True

    kvslim.hf.prepare(model)
    for label, fields in variants(budget).items():
        rec = {"model": name, "variant": label, "config": fields, "prompt_tokens": len(ids), "budget": budget}
        try:
            t0 = time.time()
            attention = "torch" if label.endswith("/torch") else None
            cache = kvslim.hf.KVSlimCache(model, kvslim.Config(**fields), attention=attention)
            rec["attention"] = cache.attention
            greedy, cache = generate(model, ids, new_tokens, sample=False, cache=cache)
            rec["greedy_seconds"] = round(time.time() - t0, 3)
            rec["resident_bytes"] = cache.resident_bytes()
            rec["seen_fp16_bytes"] = cache.seen_fp16_bytes()
            stats = cache.stats()
            rec["kept_per_layer"] = [s["tokens_kept"] if s else None for s in stats]
            rec["tokens_seen"] = stats[0]["tokens_seen"]
            rec["signal_reports"] = cache.signal_reports()
            rec["rebudgeted_layers"] = [s["figures"].get("rebudgeted") for s in stats if s]
            # The engine-side signals must have reached the caches that asked for them.
            needs = cache.layers[0].state
            rec["signals_ok"] = ((not needs.wants_attention or rec["signal_reports"]["attention"] > 0) and
                                 (not needs.wants_hidden or rec["signal_reports"]["hidden_states"] > 0))
            sampled, _ = generate(model, ids, new_tokens, sample=True,
                                  cache=kvslim.hf.KVSlimCache(model, kvslim.Config(**fields), attention=attention))
            rec["greedy"], rec["sampled"] = greedy, sampled
            rec["generated"] = len(greedy) == new_tokens and len(sampled) == new_tokens
            rec["greedy_agreement"] = sum(a == b for a, b in zip(greedy, ref_greedy)) / new_tokens
            if label.startswith("full"):
                rec["greedy_equal_dynamic"] = greedy == ref_greedy
                rec["sampled_equal_dynamic"] = sampled == ref_sampled
                # Token for token: required of the eager-arithmetic path; the caches' own fp32
                # kernels (attention="kvslim") differ from fp16 eager by rounding, so reported only.
                rec["pass"] = rec["generated"] and (rec["greedy_equal_dynamic"] or cache.attention != "torch")
            else:
                rec["pass"] = rec["generated"] and rec["resident_bytes"] > 0 and rec["signals_ok"]
        except Exception as e:  # report and go on with the other variants
            rec["pass"] = False
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
        ok &= rec["pass"]
        records.append(rec)
        if "error" in rec:
            log(f"   {label:26s} FAIL {rec['error']}")
        else:
            extra = (f" greedy==DynamicCache {rec['greedy_equal_dynamic']}, sampled==DynamicCache {rec['sampled_equal_dynamic']}"
                     if label.startswith("full") else f" greedy agreement with DynamicCache {rec['greedy_agreement']:.2f}")
            log(f"   {label:26s} {'ok  ' if rec['pass'] else 'FAIL'} [{rec['attention']}] resident {rec['resident_bytes']:>9d} B "
                f"(fp16 of all seen {rec['seen_fp16_bytes']:>9d} B, DynamicCache {ref_bytes:>9d} B), "
                f"kept/layer {rec['kept_per_layer']}, signals {rec['signal_reports']}, {rec['greedy_seconds']:.2f} s;{extra}")
    kvslim.hf.restore(model)
    return records, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "python/tests/gpu_hf_check.txt"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import transformers

    import kvslim
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)
        out.write_text("\n".join(lines) + "\n")

    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu"
    log(f"kvslim.hf check: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, kvslim {kvslim.__version__} (SIMD {kvslim.simd_target()}), device {dev}")
    # fp16: the kvslim caches keep fp16 K/V, so an fp16 model's full cache is lossless and greedy
    # output can be compared token for token with transformers' DynamicCache.
    all_records, all_ok = [], True
    for name, d, ids in models():
        try:
            records, ok = check_model(name, d, ids, args.device, torch.float16, args.new_tokens, log=log)
        except Exception as e:
            log(f"== {name}: FAIL {type(e).__name__}: {e}")
            log(traceback.format_exc())
            records, ok = [{"model": name, "pass": False, "error": str(e)}], False
        all_records += records
        all_ok &= ok
    out.with_suffix(".json").write_text(json.dumps(all_records, indent=1))
    log(f"RESULT: {'PASS' if all_ok else 'FAIL'} ({sum(r['pass'] for r in all_records)}/{len(all_records)} checks)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
