#!/usr/bin/env python3
"""One process of a transformers Llama generating through kvslim.hf, alone or as one rank of the
model under tensor parallelism (from_pretrained(..., tp_plan="auto"), issue 29). The tensor-parallel
test (test_hf_tensor_parallel.py) and the 2-GPU check (bench/cuda/device_tp.sh) run it; both
compare the ranks' records with the process alone.

    python3 hf_tp_worker.py MODEL_DIR OUT_DIR [--device cpu|cuda]            # alone: OUT_DIR/single.pkl
    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python3 hf_tp_worker.py MODEL_DIR OUT_DIR [--device cpu|cuda]        # a rank: OUT_DIR/rank{r}.pkl
    (or torchrun --nproc-per-node 2 hf_tp_worker.py ...)
    python3 hf_tp_worker.py compare OUT_DIR                                  # the ranks against the process alone

transformers starts the process group itself: gloo where torch sees no accelerator (CUDA_VISIBLE_DEVICES=""),
nccl on GPUs. For every method of METHODS the record holds the greedy tokens of model.generate, the
logits of a teacher-forced prompt and decode steps, each layer's budget and kept (batch, head,
position) rows with heads numbered as in the whole model, the resident bytes and this rank's head
slice. Alone, it also records the same logits of the model in bf16: the noise a different
arithmetic order may be compared with.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

import torch

import kvslim

PROMPT, STEPS, NEW = 200, 8, 16
BUDGET = 64
METHODS = {
    "full": dict(method="full"),
    "kivi": dict(method="kivi", kivi_bits=4, kivi_group_size=32, kivi_staging=32),
    "zipcache": dict(method="zipcache", zipcache_staging=32, zipcache_group_size=32, zipcache_saliency="attention_normalized"),
    "streaming": dict(method="streaming", streaming_budget=BUDGET),
    "h2o": dict(method="h2o", h2o_budget=BUDGET),
    "pyramidkv": dict(method="pyramidkv", pyramidkv_budget=BUDGET),
    "squeeze": dict(method="squeeze", squeeze_budget=BUDGET),
    "squeeze_hidden": dict(method="squeeze", squeeze_budget=BUDGET, squeeze_signal="hidden_cosine"),
    "squeeze_global_topk": dict(method="squeeze", squeeze_budget=BUDGET, squeeze_signal="global_topk"),
}


def save_model(model_dir: Path, head_dim: int = 64) -> None:
    """A random fp32 Llama of 3 layers, 8 query heads over 4 KV heads (head_dim 64: the device
    kernels take 64 and 128), written with save_pretrained (tensor parallelism loads from files)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=8 * head_dim, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=head_dim, num_hidden_layers=3, vocab_size=512, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)


def prompt_ids(device) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, 512, (1, PROMPT + STEPS), generator=g).to(device)


def teacher_forced_logits(model, ids, cache) -> torch.Tensor:
    """Logits [STEPS + 1, vocab] of the prompt's last position and of STEPS decode steps fed ids' last tokens."""
    prompt, follow = ids[:, :-STEPS], ids[:, -STEPS:]
    out = []
    with torch.no_grad():
        r = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1].float())
        for i in range(STEPS):
            r = model(input_ids=follow[:, i:i + 1], past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1].float())
    return torch.stack(out).cpu()


def layer_records(cache) -> list:
    """Per layer: the budget figure and the kept rows as (batch, head in the whole model, position)."""
    first = cache.tp_layout.start if cache.tp_layout is not None else 0
    out = []
    for layer in cache.layers:
        positions = layer.state.cache.view().positions  # [B, H_kv local, T]
        rows = {(b, first + h, int(p)) for b in range(positions.shape[0]) for h in range(positions.shape[1])
                for p in positions[b, h]}
        out.append({"budget": layer.state.cache.stats()["figures"].get("layer_budget"), "rows": rows})
    return out


def run_methods(model, device: str) -> dict:
    import kvslim.hf
    ids = prompt_ids(model.device)
    out = {}
    kvslim.hf.prepare(model)
    try:
        for name, spec in METHODS.items():
            config = kvslim.Config(device=device, **spec)
            cache = kvslim.hf.KVSlimCache(model, config)
            logits = teacher_forced_logits(model, ids, cache)
            rec = {"logits": logits, "layers": layer_records(cache), "bytes": cache.resident_bytes(),
                   "head_slice": cache.tp_layout.head_slice if cache.tp_layout is not None else None}
            gen_cache = kvslim.hf.KVSlimCache(model, config)
            with torch.no_grad():
                tokens = model.generate(ids[:, :PROMPT], past_key_values=gen_cache, max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=0)
            rec["tokens"] = tokens[0, PROMPT:].tolist()
            out[name] = rec
    finally:
        kvslim.hf.restore(model)
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """The largest KL(p || q) over the steps' rows of two logits tensors [steps, vocab]."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).max())


PER_LAYER_KEPT = {"full", "kivi", "zipcache", "streaming"}  # every head keeps the same positions


def compare(out_dir: Path) -> tuple[list[str], list[str]]:
    """The ranks' records against each other and the process alone: (report lines, failures).
    Failures: ranks that disagree on a budget, on a per-layer kept set or on the tokens; resident
    bytes more than 1 % apart; `full`'s tokens not the process alone's; any method whose tokens differ
    from the process alone's while its logits' KL exceeds the bf16 model's own KL to fp32."""
    single = pickle.loads((out_dir / "single.pkl").read_bytes())
    ranks = [pickle.loads(p.read_bytes()) for p in sorted(out_dir.glob("rank*.pkl"))]
    lines, failures = [f"{len(ranks)} ranks against one process"], []
    for name, alone in single["methods"].items():
        recs = [r["methods"][name] for r in ranks]
        layers = len(alone["layers"])
        budgets = [[rec["layers"][i]["budget"] for i in range(layers)] for rec in recs]
        if any(b != budgets[0] for b in budgets):
            failures.append(f"{name}: ranks disagree on the per-layer budgets {budgets}")
        if name in PER_LAYER_KEPT:
            for i in range(layers):
                kept = [{(b, p) for b, _h, p in rec["layers"][i]["rows"]} for rec in recs]
                if any(k != kept[0] for k in kept):
                    failures.append(f"{name} layer {i}: ranks keep different positions")
        if any(rec["tokens"] != recs[0]["tokens"] for rec in recs):
            failures.append(f"{name}: ranks generated different tokens")
        sizes = [rec["bytes"] for rec in recs]
        if max(sizes) > 1.01 * min(sizes):
            failures.append(f"{name}: per-rank resident bytes {sizes} differ by more than 1 %")
        rows_tp = [set().union(*(rec["layers"][i]["rows"] for rec in recs)) for i in range(layers)]
        rows_alone = [alone["layers"][i]["rows"] for i in range(layers)]
        same_rows = sum(len(a & t) for a, t in zip(rows_alone, rows_tp)) / max(1, sum(len(a) for a in rows_alone))
        tp_kl, noise = kl(alone["logits"], recs[0]["logits"]), kl(alone["logits"], alone["bf16_logits"])
        same_tokens = recs[0]["tokens"] == alone["tokens"]
        lines.append(f"{name:>20}: tokens {'equal' if same_tokens else 'DIFFER'}; KL to one process {tp_kl:.2e} "
                     f"(bf16 noise {noise:.2e}); budgets {budgets[0]} (alone {[l['budget'] for l in alone['layers']]}); "
                     f"kept rows shared with one process {100 * same_rows:.1f} %; bytes per rank {sizes} (alone {alone['bytes']})")
        if name == "full" and not same_tokens:
            failures.append("full: tokens differ from the process alone's")
        if not same_tokens and tp_kl > noise:
            failures.append(f"{name}: tokens differ from the process alone's and KL {tp_kl:.2e} exceeds bf16's {noise:.2e}")
    return lines, failures


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "compare":
        lines, failures = compare(Path(sys.argv[2]))
        print("\n".join(lines + [f"FAIL {f}" for f in failures] + ["PASS" if not failures else "FAILED"]))
        return 1 if failures else 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where kvslim's caches live")
    args = ap.parse_args()
    from transformers import LlamaForCausalLM
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ:
        model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, tp_plan="auto").eval()
        record = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                  "methods": run_methods(model, args.device)}
        name = f"rank{record['rank']}.pkl"
    else:
        where = "cuda" if args.device == "cuda" else "cpu"
        model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(where).eval()
        record = {"rank": None, "world": 1, "methods": run_methods(model, args.device)}
        half = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(where).eval()
        bf16 = run_methods(half, args.device)
        for name_, rec in bf16.items():
            record["methods"][name_]["bf16_logits"] = rec["logits"]
        name = "single.pkl"
    with open(args.out_dir / name, "wb") as f:
        pickle.dump(record, f)
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
