#!/usr/bin/env python3
"""Adds fp16-KV reference logits to tests/golden/tiny: the same HF transformers forward as
golden.json's windows (bf16 weights upcast to fp32, eager attention, CPU), but with the keys
(after RoPE) and values rounded to fp16 before attention -- what kvslim's fp16 cache stores.
The difference between the two references is the part of |engine - HF| that fp16 KV storage
explains; tests/engine/golden_model_test.cc bounds the engine by it.

    python3 training/golden_fp16kv.py [--model models/tiny] [--golden tests/golden/tiny]

Runs where transformers is installed (the GPU machine; CPU is enough). Rounding is patched into
modeling_llama's eager attention function itself, so the eager causal mask stays as it is (a
custom function registered under a new name would get no causal mask from transformers 5).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/tiny"))
    ap.add_argument("--golden", type=Path, default=Path("tests/golden/tiny"))
    args = ap.parse_args()

    import transformers.models.llama.modeling_llama as ml
    from transformers import LlamaForCausalLM

    plain = ml.eager_attention_forward

    def fp16kv(module, query, key, value, attention_mask, **kw):
        return plain(module, query, key.half().float(), value.half().float(), attention_mask, **kw)

    torch.set_num_threads(8)
    model = LlamaForCausalLM.from_pretrained(str(args.model), attn_implementation="eager").float().eval()
    gpath = args.golden / "golden.json"
    golden = json.loads(gpath.read_text())
    with torch.no_grad():
        for w in golden["windows"]:
            x = torch.tensor([w["input_ids"]])
            ml.eager_attention_forward = plain
            l32 = model(input_ids=x).logits[0].float()
            ml.eager_attention_forward = fp16kv
            l16 = model(input_ids=x).logits[0].float()
            ml.eager_attention_forward = plain
            ref = torch.from_numpy(__import__("numpy").fromfile(args.golden / w["logits_file"], dtype="<f4")).view(len(w["logit_positions"]), -1)
            n_last = ref.shape[0]
            recomputed = float((l32[-n_last:] - ref).abs().max())
            assert recomputed < 1e-4, f"{w['name']}: fp32 logits differ from golden.json by {recomputed}"
            f16 = f"{w['name']}.logits_fp16kv.f32"
            l16[-n_last:].contiguous().numpy().astype("<f4").tofile(args.golden / f16)
            w["logits_fp16kv_file"] = f16
            w["fp16kv_vs_fp32_max_abs"] = float((l16[-n_last:] - l32[-n_last:]).abs().max())
            w["argmax_all_positions_fp16kv"] = l16.argmax(-1).tolist()
            same = sum(int(a == b) for a, b in zip(w["argmax_all_positions"], w["argmax_all_positions_fp16kv"]))
            print(f"{w['name']}: fp16-KV vs fp32 max |dlogit| {w['fp16kv_vs_fp32_max_abs']:.4g}, argmax same {same}/{len(w['argmax_all_positions'])}; fp32 recomputed vs golden {recomputed:.2g}")
    gpath.write_text(json.dumps(golden) + "\n")


if __name__ == "__main__":
    main()
