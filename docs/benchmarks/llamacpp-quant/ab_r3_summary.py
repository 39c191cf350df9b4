#!/usr/bin/env python3
"""Summary of ab_r3.sh's raw files: best of rounds (and repetitions) per engine, and per round."""
import glob, json, os, re, sys

raw = sys.argv[1]
# Runs left out: two invocations of ab_r3.sh overlapped for ~9 s at 14:06:19-14:06:28 UTC (rounds 1-3,
# then 4-5 started before the first had finished), so these two ran beside another benchmark.
EXCLUDED = {"kvslim_new_q4_k_m_t1_r3.json", "llama_q4_0_t2_r4.json"}
if os.path.basename(os.path.normpath(raw)) != "raw_r3":  # those two are raw_r3's (later runs: none)
    EXCLUDED = set()
types = ["q4_0", "q8_0", "q4_k_m"]
names = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
rounds = sorted({int(m.group(1)) for p in os.listdir(raw) if (m := re.search(r"_r(\d+)\.json$", p))})

def load(p):  # None for a missing, unfinished or excluded file
    if os.path.basename(p) in EXCLUDED:
        return None
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None

def llama(t, th, r):  # (pp, tg): best of the run's repetitions
    pp = tg = 0.0
    rows = load(os.path.join(raw, f"llama_{t}_t{th}_r{r}.json"))
    if rows:
        for row in rows:
            if row["n_gen"] == 0:
                pp = max(pp, max(row["samples_ts"]))
            else:
                tg = max(tg, max(row["samples_ts"]))
    return pp, tg

def kv(which, t, th, r):  # (prefill, decode) of the full cache: best of the run's repetitions
    data = load(os.path.join(raw, f"kvslim_{which}_{t}_t{th}_r{r}.json"))
    if not data:
        return 0.0, 0.0
    run = [x for x in data["runs"] if x["method"] == "full"][0]
    return run["prefill_tokens_per_s"], run["decode_tokens_per_s"]

def bold(x):
    return f"**{x:.2f}**" if x >= 1 else f"{x:.2f}"

print(f"Best of {len(rounds)} rounds (rounds {rounds}) and of each run's 2 repetitions; tokens/s.\n")
print("| weights | threads | llama.cpp prefill / decode | kvslim old prefill / decode | kvslim new prefill / decode "
      "| decode ratio old | decode ratio new | prefill ratio new |")
print("|---|---|---|---|---|---|---|---|")
per_round = []
medians = []
def median(xs):  # of the runs that finished (0.0: left out)
    xs = sorted(x for x in xs if x > 0)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else 0.0
for t in types:
    for th in (2, 1):
        L = [llama(t, th, r) for r in rounds]
        O = [kv("old", t, th, r) for r in rounds]
        N = [kv("new", t, th, r) for r in rounds]
        lp, lt = max(x[0] for x in L), max(x[1] for x in L)
        op, ot = max(x[0] for x in O), max(x[1] for x in O)
        np_, nt = max(x[0] for x in N), max(x[1] for x in N)
        if not (lt and lp and ot and nt):
            continue
        print(f"| {names[t]} | {th} | {lp:.1f} / {lt:.1f} | {op:.1f} / {ot:.1f} | {np_:.1f} / {nt:.1f} "
              f"| {bold(ot / lt)} | {bold(nt / lt)} | {bold(np_ / lp)} |")
        lm, om, nm = median([x[1] for x in L]), median([x[1] for x in O]), median([x[1] for x in N])
        wins = sum(1 for l, n in zip(L, N) if l[1] > 0 and n[1] > l[1])
        both = sum(1 for l, n in zip(L, N) if l[1] > 0 and n[1] > 0)
        medians.append(f"{names[t]}, {th} thread(s): llama.cpp {lm:.1f}, old {om:.1f}, new {nm:.1f} "
                       f"(new / llama.cpp {nm / lm:.2f}); new faster than llama.cpp in {wins} of {both} rounds")
        per_round.append(f"{names[t]}, {th} thread(s): llama.cpp " + ", ".join(f"{x[1]:.1f}" for x in L) +
                         "; old " + ", ".join(f"{x[1]:.1f}" for x in O) + "; new " + ", ".join(f"{x[1]:.1f}" for x in N))
print("\nDecode per round (each run's best repetition; 0.0: left out, see EXCLUDED in ab_r3_summary.py):\n")
for line in per_round:
    print(f"- {line}")
print("\nDecode, median of rounds (and rounds in which the new binary beat llama.cpp's run of the same round):\n")
for line in medians:
    print(f"- {line}")
