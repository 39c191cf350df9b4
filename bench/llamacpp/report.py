#!/usr/bin/env python3
"""Merges bench/llamacpp/run.sh's raw outputs into results.json, results.md and kl_vs_bytes.png.

    report.py MODEL_DIR RAW_DIR OUT_DIR THREADS KL_CTX
Standard library only (the machine has no numpy); the PNG is drawn by gnuplot.
"""
import glob
import json
import os
import re
import subprocess
import sys

model_dir, raw, out, kl_ctx = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[5])
thread_counts = [int(t) for t in sys.argv[4].split()]
cfg = json.load(open(os.path.join(model_dir, "config.json")))
layers, kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
elems_per_token = 2 * layers * kv_heads * head_dim  # K and V of every layer
# ggml's storage per element: f16 2 bytes, q8_0 34 bytes / 32, q4_0 18 bytes / 32, f32 4.
LLAMA_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def llama_bench(path):
    """(n_prompt, n_gen, n_depth) -> [best, mean, sd] tokens/s: best of the repetitions, as kvslim's."""
    rows = json.load(open(path))
    return {(r["n_prompt"], r["n_gen"], r.get("n_depth", 0)): [max(r["samples_ts"]), r["avg_ts"], r["stddev_ts"]]
            for r in rows}


speed = {}  # threads -> {"contexts", "llama.cpp": {config: {ctx: {prefill, decode}}}, "kvslim": {...}}
for t in thread_counts:
    sp = {"contexts": [], "llama.cpp": {}, "kvslim": {}}
    for kv in ["f16", "q8_0", "q4_0", "f16_nofa"]:
        p, d = os.path.join(raw, f"llama_prefill_{kv}_t{t}.json"), os.path.join(raw, f"llama_decode_{kv}_t{t}.json")
        if not os.path.exists(p):
            continue
        entry = {}
        for (n_prompt, n_gen, depth), v in llama_bench(p).items():
            if n_gen == 0:
                entry.setdefault(str(n_prompt), {})["prefill"] = v
        for (n_prompt, n_gen, depth), v in llama_bench(d).items():
            if n_prompt == 0:
                entry.setdefault(str(depth), {})["decode"] = v
        sp["llama.cpp"]["f16 (no flash attn)" if kv == "f16_nofa" else f"{kv} (flash attn)"] = entry
    for path in sorted(glob.glob(os.path.join(raw, f"kvslim_speed_*_t{t}.json"))):
        j = json.load(open(path))
        label = os.path.basename(path)[len("kvslim_speed_"):-len(f"_t{t}.json")]
        entry = {}
        for r in j["runs"]:
            entry[str(r["context"])] = {"prefill": [r["prefill_tokens_per_s"]], "decode": [r["decode_tokens_per_s"]],
                                        "kv_resident_bytes": r["kv_resident_bytes"]}
        sp["kvslim"][label] = entry
        sp["contexts"] = sorted({int(c) for c in entry})
    speed[str(t)] = sp

fidelity = []
ref_ppl = None
for kv in ["f16", "q8_0", "q4_0"]:
    path = os.path.join(raw, f"llama_kld_{kv}.txt")
    if not os.path.exists(path):
        continue
    text = open(path, errors="replace").read()
    def grab(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    ref_ppl = grab(r"Mean PPL\(base\)\s*:\s*([0-9.]+)")
    fidelity.append({"engine": "llama.cpp", "label": f"llama.cpp {kv}", "kv_bytes_per_token": LLAMA_BYTES[kv] * elems_per_token,
                     "kl_vs_fp32": grab(r"Mean\s+KLD:\s*([0-9.eE+-]+)"), "top1_vs_fp32": grab(r"Same top p:\s*([0-9.]+)") / 100,
                     "ppl": grab(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"), "kl_vs_own_full": None})
for path in sorted(glob.glob(os.path.join(raw, "kvslim_kld_*.json"))):
    j = json.load(open(path))
    r = j["refs"]["llama_f32"]
    own = j["refs"].get("kvslim_full")
    fidelity.append({"engine": "kvslim", "label": "kvslim " + j["label"], "kv_bytes_per_token": j["kv_bytes_per_token"],
                     "kl_vs_fp32": r["mean_kld"], "top1_vs_fp32": r["same_top"], "ppl": r["ppl"],
                     "kl_vs_own_full": own["mean_kld"] if own else None, "scored_tokens": j["scored_tokens"]})
fidelity.sort(key=lambda f: (f["engine"], -f["kv_bytes_per_token"]))

result = {"model": model_dir, "config": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
          "speed_threads": thread_counts, "kl_ctx": kl_ctx, "reference": "llama.cpp, F32 weights, f32 KV cache (llama-perplexity --kl-divergence-base)",
          "reference_ppl": ref_ppl, "speed": speed, "fidelity": fidelity}
os.makedirs(out, exist_ok=True)
json.dump(result, open(os.path.join(out, "results.json"), "w"), indent=2)

# ---- Markdown tables
lines = [f"Model `{model_dir}` ({layers} layers, {kv_heads} KV heads x {head_dim}), F16 weights for speed.", ""]
for t, sp in speed.items():
    ctxs = sp["contexts"]
    lines.append(f"Speed at {t} thread(s), tokens/s, best of the repetitions (llama.cpp: best, then mean ± sd): "
                 "prefill of C tokens; decode of the next tokens after C:")
    lines.append("")
    lines.append("| engine / KV | " + " | ".join(f"prefill {c}" for c in ctxs) + " | " + " | ".join(f"decode @{c}" for c in ctxs) + " |")
    lines.append("|---|" + "---|" * (2 * len(ctxs)))
    for engine in ["llama.cpp", "kvslim"]:
        for label, entry in sp[engine].items():
            cells = []
            for kind in ["prefill", "decode"]:
                for c in ctxs:
                    v = entry.get(str(c), {}).get(kind)
                    cells.append("-" if not v else f"{v[0]:.0f}" + (f" ({v[1]:.0f} ± {v[2]:.0f})" if len(v) > 1 else ""))
            lines.append(f"| {engine} {label} | " + " | ".join(cells) + " |")
    best_llama = {}
    for kind in ["prefill", "decode"]:
        for c in ctxs:
            vals = [e.get(str(c), {}).get(kind, [0])[0] for k, e in sp["llama.cpp"].items() if k.startswith("f16")]
            best_llama[(kind, c)] = max(vals) if vals else None
    if "full" in sp["kvslim"] and any(best_llama.values()):
        lines.append("")
        lines.append(f"kvslim full / llama.cpp's faster f16 configuration ({t} thread(s)): " + ", ".join(
            f"{kind} @{c}: {sp['kvslim']['full'][str(c)][kind][0] / best_llama[(kind, c)]:.2f}x"
            for kind in ["prefill", "decode"] for c in ctxs if best_llama.get((kind, c))))
    lines.append("")
lines.append("")
lines.append(f"Fidelity against the fp32 reference (llama.cpp, F32 weights, f32 KV; reference PPL {ref_ppl}), "
             f"llama-perplexity's protocol: chunks of {kl_ctx} tokens, second half scored:")
lines.append("")
lines.append("| engine | KV bytes/token | mean KL vs fp32 | top-1 vs fp32 | PPL | KL vs kvslim full |")
lines.append("|---|---|---|---|---|---|")
for f in fidelity:
    own = f"{f['kl_vs_own_full']:.6f}" if f.get("kl_vs_own_full") is not None else "-"
    lines.append(f"| {f['label']} | {f['kv_bytes_per_token']:.0f} | {f['kl_vs_fp32']:.6f} | {100 * f['top1_vs_fp32']:.2f}% | "
                 f"{f['ppl']:.4f} | {own} |")
open(os.path.join(out, "results.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

# ---- PNG: KL vs bytes per token, both engines
if not fidelity:
    print("no fidelity points: no plot")
    sys.exit(0)
dat = os.path.join(out, "kl_vs_bytes.dat")
with open(dat, "w") as f:
    for engine in ["llama.cpp", "kvslim"]:
        f.write(f"# {engine}\n")
        for p in fidelity:
            if p["engine"] == engine:
                f.write(f"{p['kv_bytes_per_token']:.2f} {max(p['kl_vs_fp32'], 1e-7):.8g} \"{p['label'].split(' ', 1)[1]}\"\n")
        f.write("\n\n")
png = os.path.join(out, "kl_vs_bytes.png")
script = f"""
set terminal pngcairo size 900,600 noenhanced
set output '{png}'
set logscale y
set xlabel 'resident KV bytes per token'
set ylabel 'mean KL vs fp32 reference (nats)'
set title 'KV cache fidelity vs memory: {os.path.basename(model_dir.rstrip("/"))}, {kl_ctx}-token chunks'
set key top right
set grid
plot '{dat}' index 0 using 1:2 with points pt 7 ps 1.5 title 'llama.cpp', \\
     '' index 0 using 1:2:3 with labels offset 1,0.6 left font ',8' notitle, \\
     '' index 1 using 1:2 with points pt 5 ps 1.5 title 'kvslim', \\
     '' index 1 using 1:2:3 with labels offset 1,-0.6 left font ',8' notitle
"""
subprocess.run(["gnuplot"], input=script, text=True, check=True)
os.remove(dat)
print("wrote", os.path.join(out, "results.json"), os.path.join(out, "results.md"), png)
