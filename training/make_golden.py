#!/usr/bin/env python3
"""Writes the random-weight golden models that the C++ engine's loader tests read.

    /usr/bin/python3 training/make_golden.py [--out tests/golden] [--check-with-transformers]
    python3 training/make_golden.py --verify     # GPU machine: transformers vs committed files

Needs python3-torch (Debian's 1.13 is enough) and numpy; CPU only, a few seconds.
Everything is seeded. Output (format: tests/golden/README.md):
  models/llama_gqa/   random Llama, GQA 4q/2kv heads of 16, untied, llama3 rope scaling,
                      bf16, 2 shards + model.safetensors.index.json, config.json in the
                      transformers-4 style (rope_theta / rope_scaling / torch_dtype)
  models/qwen2_tied/  random Qwen2, q/k/v bias, tied embeddings, fp16, single file,
                      config.json in the transformers-5 style (rope_parameters / dtype)
  models/llama_f32/   random Llama, fp32, 6q/3kv heads of 8, rope_theta 5e5, no scaling
The reference logits come from training/hf_llama.py, a re-implementation of the
transformers Llama/Qwen2 forward (eager attention) run in fp32 on the weights exactly
as stored (bf16/fp16 upcast). With --check-with-transformers (needs transformers >= 4.45)
each model is also loaded with transformers and the logits are compared.
The tokenizer golden files are made by training/node/build_tokenizers.js.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_llama as H  # noqa: E402

VOCAB = 320
SEQ = 40


def log(msg: str) -> None:
    print(f"[make_golden] {msg}", flush=True)


def randomize(model: H.CausalLM, seed: int) -> None:
    """Non-trivial random weights (HF's default init gives near-zero logits and zero
    biases, which would let a loader bug pass): RMSNorm weights 1 + 0.2 N(0,1),
    biases 0.1 N(0,1), embeddings 0.5 N(0,1), linear weights N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * r)
            elif "embed_tokens" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[1]))


def make(name: str, cfg: H.Config, seed: int, dtype, shards: int, style: str, out: Path,
         input_ids: list[int], notes: dict, check_hf: bool) -> None:
    model = H.CausalLM(cfg)
    randomize(model, seed)
    mdir = out / "models" / name
    if mdir.exists():
        shutil.rmtree(mdir)
    files = H.save_pretrained(model, mdir, dtype, shards=shards, config_style=style)
    # Reference: reload what was written (so the logits see the rounded weights), fp32.
    ref = H.load_pretrained(mdir, torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([input_ids]))[0]            # [SEQ, VOCAB]
    golden = {
        "model_dir": f"tests/golden/models/{name}",
        "stored_dtype": str(dtype).replace("torch.", ""),
        "config_style": style,
        "compute": "training/hf_llama.py (transformers Llama/Qwen2 eager forward re-implemented), "
                   "weights as stored upcast to fp32, CPU",
        "input_ids": input_ids,
        "logits_shape": list(logits.shape),
        "logits": [[float(v) for v in row] for row in logits],
        "argmax": logits.argmax(-1).tolist(),
        "rope_inv_freq": ref.inv_freq.tolist(),
        "notes": notes,
    }
    (mdir / "golden.json").write_text(json.dumps(golden) + "\n")
    log(f"{mdir}: {files}, logits {list(logits.shape)}, |logit| mean {logits.abs().mean():.3f}")
    if check_hf:
        compare_with_transformers(mdir, input_ids, logits)


def compare_with_transformers(mdir: Path, input_ids, logits) -> None:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(mdir), attn_implementation="eager").to(torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([input_ids])).logits[0].float()
    diff = float((ref - logits).abs().max())
    log(f"{mdir.name}: max |transformers - hf_llama| = {diff:.3e}")
    if diff > 1e-4:
        raise SystemExit(f"{mdir}: transformers disagrees with hf_llama.py by {diff}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "golden")
    ap.add_argument("--check-with-transformers", action="store_true")
    ap.add_argument("--verify", action="store_true",
                    help="write nothing: load the committed golden models with transformers and compare logits")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.verify:
        for name in ("llama_gqa", "qwen2_tied", "llama_f32"):
            mdir = args.out / "models" / name
            golden = json.loads((mdir / "golden.json").read_text())
            compare_with_transformers(mdir, golden["input_ids"], torch.tensor(golden["logits"]))
        return
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g).tolist()

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    make("llama_gqa",
         H.Config(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=llama3,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
         seed=11, dtype=torch.bfloat16, shards=2, style="v4", out=args.out, input_ids=ids,
         notes={"what": "random LlamaForCausalLM, GQA 4q/2kv heads of 16, untied, llama3 rope scaling",
                "positions": f"0..{SEQ - 1}; positions >= 32 exceed original_max_position_embeddings"},
         check_hf=args.check_with_transformers)
    make("qwen2_tied",
         H.Config(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, attention_bias=True, bos_token_id=None, eos_token_id=1),
         seed=12, dtype=torch.float16, shards=1, style="v5", out=args.out, input_ids=ids,
         notes={"what": "random Qwen2ForCausalLM, q/k/v bias, tied embeddings (no lm_head.weight stored), "
                        "head_dim 16, rope_theta 1e6, rms_norm_eps 1e-6"},
         check_hf=args.check_with_transformers)
    make("llama_f32",
         H.Config(model_type="llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                  max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
         seed=13, dtype=torch.float32, shards=1, style="v4", out=args.out, input_ids=ids,
         notes={"what": "random LlamaForCausalLM stored in fp32, 6q/3kv heads of 8, untied, rope_theta 5e5"},
         check_hf=args.check_with_transformers)


if __name__ == "__main__":
    main()
