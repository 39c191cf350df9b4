#!/usr/bin/python3
# The KL-vs-bytes front of docs/results.md (issue 23) from the eval JSONs beside this file:
# writes front.dat (one line per point) and front.png through gnuplot.
import json, subprocess, os
here = os.path.dirname(os.path.abspath(__file__))
rows = []
# composed_text.json's g64 points predate decode rows compressed 16 at a time: composed_g64_text.json
# holds the g64 variants as they are now.
for name in ("composed_text.json", "composed_g64_text.json", "alone_text.json"):
    d = json.load(open(os.path.join(here, name)))
    for p in d["points"]:
        if name == "composed_text.json" and p["variant"].endswith("_g64"):
            continue
        for t in p["text"]:
            rows.append(((p["variant"], p.get("level_target")), t))
with open(os.path.join(here, "front.dat"), "w") as f:
    f.write("# variant bytes_pct kl_ood kl_ood_lo kl_ood_hi kl_ind kl_ind_lo kl_ind_hi\n")
    by = {}
    for name, t in rows:
        by.setdefault(name, {})["ood" if t["source"] == "heldout" else "ind"] = t
    for (name, _), texts in by.items():
        o, i = texts["ood"], texts["ind"]
        f.write("%s %.2f %.5f %.5f %.5f %.5f %.5f %.5f\n" % (name, 100 * o["level"], o["kl"], o["kl_ci95"][0], o["kl_ci95"][1],
                                                            i["kl"], i["kl_ci95"][0], i["kl_ci95"][1]))
groups = [("squeeze+kivi4_g64|h2o+kivi4_g64", "policy over kivi4, groups of 64 (squeeze, h2o)"),
          ("squeeze+kivi4|h2o+kivi4", "policy over kivi4, groups of 32 (squeeze, h2o)"),
          ("squeeze_s1", "eviction alone (squeeze, fp16 rows)"),
          ("kivi2|kivi4|zipcache_4_2_h20_attn", "quantization alone (kivi2, kivi4, zipcache attention)")]
plots = []
for i, (names, title) in enumerate(groups):
    sel = "|".join("^" + n.replace("+", "[+]") + " " for n in names.split("|"))
    plots.append("\"< grep -E '%s' HERE/front.dat\" using 2:3:4:5 with yerrorbars pt %d ps 1.2 title '%s (out-of-domain)'" % (sel, 7 + i, title))
    plots.append("\"< grep -E '%s' HERE/front.dat\" using 2:6:7:8 with yerrorbars pt %d ps 0.8 title '   in-distribution'" % (sel, 7 + i))
script = """
set terminal pngcairo size 1000,600 noenhanced
set output 'HERE/front.png'
set title 'models/tiny, context 512, 12 windows per text: KL(full || method) vs resident KV bytes (95 % intervals)'
set xlabel 'resident KV bytes after the prefill, % of the full cache'
set ylabel 'mean KL(full || method), nats'
set logscale y
set key top right font ',9'
set grid
set xrange [10:52]
plot """ + ", \\\n     ".join(plots) + """, 0.05 with lines dt 2 lc rgb 'gray' title 'KL 0.05'
"""
script = script.replace("HERE", here)
subprocess.run(["gnuplot"], input=script, text=True, check=True)
