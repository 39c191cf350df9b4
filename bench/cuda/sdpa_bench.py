#!/usr/bin/env python3
"""torch SDPA decode attention over bf16 KV at the shapes of `kvslim bench attend --device cuda`,
and the table that puts both side by side: each kvslim kernel's time, its speed-up over SDPA, the
GB/s of the bytes it reads and their share of the device copy bandwidth (measured by kvslim's run).

    python3 bench/cuda/sdpa_bench.py --kvslim attend_cuda.json [--json sdpa.json]

SDPA gets the same treatment as kvslim's kernels: one query token, GQA (enable_gqa), as many
layers as keep the KV several times larger than the L2, CUDA events, median of the repeats."""
import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F


def timed_ms(run):
    """GPU ms of one run(), between two CUDA events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    run()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def median_us(run, repeats, calls):
    """Median us per call of run() (`calls` calls each time) over `repeats` runs, by CUDA events."""
    return statistics.median(timed_ms(run) * 1e3 / calls for _ in range(repeats))


def warm_up(run, ms=50.0):
    """run() until the GPU has spent `ms` on it (at least 3 times), as kvslim's bench does: a GPU
    left idle by the set-up starts below its clocks (docs/benchmarks/cuda/device_s61/r5)."""
    spent, n = 0.0, 0
    while n < 3 or spent < ms:
        spent += timed_ms(run)
        n += 1


def sdpa_time(B, N, Hq, Hkv, D, repeats):
    kv_bytes = B * Hkv * N * D * 2 * 2
    layers = int(min(16, max(1, math.ceil(512e6 / kv_bytes))))
    g = torch.Generator(device="cuda").manual_seed(1)
    ks = [torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    vs = [torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def layers_once():
        for k, v in zip(ks, vs):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    warm_up(layers_once)
    eager_us = median_us(layers_once, repeats, layers)
    # The same calls captured as one CUDA graph and replayed (kvslim's "graph us" column): the
    # kernels without the host's launches.
    graph_us = -1.0
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layers_once()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers_once()
        warm_up(graph.replay)
        graph_us = median_us(graph.replay, repeats, layers)
        del graph
    except RuntimeError as e:
        print(f"# SDPA graph capture failed: {e}")
    ks.clear()  # the KV freed before the next shape
    vs.clear()
    torch.cuda.empty_cache()
    return eager_us, graph_us, kv_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvslim", required=True, help="JSON of kvslim bench attend --device cuda --json")
    ap.add_argument("--json", help="write the SDPA rows here")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    ks = json.load(open(a.kvslim))
    copy = ks["copy_gbs"]
    rows = [r for r in ks["rows"] if r["kind"] == "attend"]
    shapes = sorted({(r["head_dim"], r["batch"], r["context"], r["q_heads"], r["kv_heads"]) for r in rows})
    print(f"# {ks['device']}; torch {torch.__version__}; device copy {copy:.0f} GB/s (read + write)")
    print("# eager: one call after another from the host; graph: the same calls replayed as one CUDA graph")
    print(f"{'D':>4} {'B':>3} {'context':>7} {'SDPA us':>9} {'graph':>7} {'SDPA GB/s':>9} | cache  {'us':>9} {'x SDPA':>7} "
          f"{'graph us':>9} {'x SDPA':>7} {'GB/s':>6} {'%copy':>6}")
    out = []
    for D, B, N, Hq, Hkv in shapes:
        us, graph_us, kv_bytes = sdpa_time(B, N, Hq, Hkv, D, a.repeats)
        sdpa_gbs = kv_bytes / (us * 1e-6) / 1e9
        out.append({"head_dim": D, "batch": B, "context": N, "q_heads": Hq, "kv_heads": Hkv, "us": us,
                    "graph_us": graph_us, "gbs": sdpa_gbs})
        for r in rows:
            if (r["head_dim"], r["batch"], r["context"]) != (D, B, N):
                continue
            g = r.get("graph_us", -1.0)
            g_ratio = f"{graph_us / g:6.2f}x" if g > 0 and graph_us > 0 else "    n/a"
            g_col = f"{g:9.1f}" if g > 0 else "      n/a"
            print(f"{D:4d} {B:3d} {N:7d} {us:9.1f} {graph_us:7.1f} {sdpa_gbs:9.0f} | {r['cache']:<6} {r['us']:9.1f} "
                  f"{us / r['us']:6.2f}x {g_col} {g_ratio} {r['gbs']:6.0f} {100 * r['gbs'] / copy:5.0f}%", flush=True)
    for r in ks["rows"]:
        if r["kind"] == "append":
            print(f"append 1 token, batch {r['batch']}, {r['cache']}: {r['us']:.2f} us/step vs bf16 copy "
                  f"{r['copy_us']:.2f} us ({r['us'] / r['copy_us']:.2f}x)")
    if a.json:
        json.dump({"torch": torch.__version__, "rows": out}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
