"""Retrieval through transformers + kvslim.hf, on the episodes `kvslim eval` scores, with each cache
on the GPU (Config(device="cuda")) and the same cache on the CPU under the same GPU model: issue
25's check that the GPU path answers what the CPU path answers (same episodes, same settings).

The episodes come from the CLI, so both engines read the same token ids:
    kvslim eval --model models/tiny --dump-episodes episodes.jsonl      (the quick preset's tasks)
    python3 bench/cuda/hf_retrieval.py --episodes episodes.jsonl --out DIR

Settings, as the evaluator runs them (src/engine/eval/retrieval.cc): "inside" feeds the prompt with
its question in one call; "later" feeds the document in one call (a compressing cache decides what
it keeps there), the question in the next, and, for kvlist / multikey, the episode's follow-up
questions after the model's own answers (its `turns`). Greedy; an answer is correct when its
tokens equal the expected ones; the last turn stops at its first wrong token, as the evaluator's.
Eviction methods keep `--fraction` of each episode's document tokens per head.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def argmax_last(logits):
    return int(logits[0, -1].argmax())


def answer(model, cache, calls, answers, follow_ups):
    """Feeds `calls` (lists of token ids, one model call each), then decodes each turn's answer
    greedily; between turns, the last answer token and the next follow-up question go in one call.
    Returns (per-turn generated ids, per-turn correct)."""
    dev = model.device
    with torch.no_grad():
        for ids in calls:
            logits = model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True).logits
        generated, correct = [], []
        for t, expected in enumerate(answers):
            last = t + 1 == len(answers)
            out = []
            for i in range(len(expected)):
                nxt = argmax_last(logits)
                out.append(nxt)
                if i + 1 == len(expected) or (last and nxt != expected[i]):
                    break
                logits = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True).logits
            generated.append(out)
            correct.append(out == expected)
            if last:
                break
            feed = [out[-1]] + follow_ups[t]["question"]
            logits = model(input_ids=torch.tensor([feed], device=dev), past_key_values=cache, use_cache=True).logits
    return generated, correct


def config_of(method, episode, fraction, device=None):
    """The kvslim.Config of `method` for one episode: a method spec -- a method or one of the
    registry's eval variants ("full", "kivi2", "kivi4", "h2o", "pyramidkv"; kvslim.variants()),
    optionally @field=value,... -- with the budget field its registry row names (eviction) set to
    keep `fraction` of the document's tokens, on `device` when given."""
    import kvslim
    cfg = kvslim.Config.from_spec(method)
    budget_field = kvslim.method_info(cfg.method)["budget_field"]
    if budget_field is not None:
        setattr(cfg, budget_field, max(48, int(fraction * episode["question_start"])))
    if device is not None:
        cfg.device = device
    cfg.validate()
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", required=True, help="kvslim eval --dump-episodes output")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=str(ROOT / "models/tiny"))
    ap.add_argument("--methods", default="full,kivi2,kivi4,h2o,pyramidkv",
                    help="comma-separated methods or registry eval variants (kvslim.variants())")
    ap.add_argument("--fraction", type=float, default=0.25, help="eviction: share of the document's tokens kept")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import kvslim
    import kvslim.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    model = model.cuda().eval()
    episodes = [json.loads(line) for line in Path(args.episodes).read_text().splitlines() if line.strip()]
    kvslim.hf.prepare(model)
    records, lines = [], []

    def log(line):
        print(line, flush=True)
        lines.append(line)
        (out / "hf_retrieval.txt").write_text("\n".join(lines) + "\n")

    log(f"hf_retrieval: {torch.cuda.get_device_name(0)}, {args.model} ({args.dtype}), {len(episodes)} episodes, "
        f"eviction keeping {args.fraction:.0%} of each document")
    t0 = time.time()
    mismatched = 0
    log(f"{'method':10s} {'task':9s} {'setting':8s} {'turn':>4s} {'n':>4s} {'cpu':>6s} {'cuda':>6s} {'differ':>6s}")
    for method in args.methods.split(","):
        for ep in episodes:
            prompt, qs = ep["prompt"], ep["question_start"]
            settings = {
                "inside": ([prompt], [ep["answer"]]),
                "later": ([prompt[:qs], prompt[qs:]],
                          [ep["answer"]] + [f["answer"] for f in ep["follow_ups"][: max(ep["turns"], 1) - 1]]),
            }
            for setting, (calls, answers) in settings.items():
                rec = {"method": method, "task": ep["task"], "length": ep["length"], "depth": ep["depth"], "setting": setting}
                for where in ("cpu", "cuda"):
                    cfg = config_of(method, ep, args.fraction, "cuda" if where == "cuda" else None)
                    cache = kvslim.hf.KVSlimCache(model, cfg, attention="kvslim")
                    gen, ok = answer(model, cache, calls, answers, ep["follow_ups"])
                    rec[f"{where}_generated"], rec[f"{where}_correct"] = gen, ok
                rec["same_tokens"] = rec["cpu_generated"] == rec["cuda_generated"]
                records.append(rec)
        # Accuracy per (task, setting, turn) on each path, and the answers whose tokens differ:
        # written as each method ends, so a run cut short still reports the methods it finished.
        mismatched += summarize([r for r in records if r["method"] == method], log)
        log(f"  {method} done ({time.time() - t0:.0f} s)")
        (out / "hf_retrieval.json").write_text(json.dumps(records))
    kvslim.hf.restore(model)
    log(f"answers that differ between the CPU and the GPU path: {mismatched}")
    return 0


def summarize(records, log) -> int:
    """Logs one method's accuracy rows; returns how many answers differ between the paths."""
    mismatched = 0
    for task, setting in sorted({(r["task"], r["setting"]) for r in records}):
        rs = [r for r in records if (r["task"], r["setting"]) == (task, setting)]
        turns = max(len(r["cpu_correct"]) for r in rs)
        for t in range(turns):
            at = [r for r in rs if len(r["cpu_correct"]) > t and len(r["cuda_correct"]) > t]
            cpu = sum(r["cpu_correct"][t] for r in at) / len(at)
            gpu = sum(r["cuda_correct"][t] for r in at) / len(at)
            differ = sum(r["cpu_generated"][t] != r["cuda_generated"][t] for r in at)
            mismatched += differ
            log(f"{rs[0]['method']:10s} {task:9s} {setting:8s} {t + 1:4d} {len(at):4d} {cpu:6.2f} {gpu:6.2f} {differ:6d}")
    return mismatched


if __name__ == "__main__":
    sys.exit(main())
