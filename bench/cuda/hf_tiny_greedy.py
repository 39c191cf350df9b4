#!/usr/bin/env python3
"""models/tiny in fp32 on the GPU: greedy tokens of transformers' DynamicCache (SDPA) against
kvslim's device caches decoded eagerly and by kvslim.hf.GraphDecoder, from the same prompt.

    python3 bench/cuda/hf_tiny_greedy.py --out DIR [--prompt 1900] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_generate import file_logger, tiny_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=1900)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    log = file_logger(Path(args.out), "hf_tiny_greedy.txt")
    import transformers
    from transformers import DynamicCache

    import kvslim
    import kvslim.hf
    model, tok, ids = tiny_model(torch.float32, args.prompt)
    new = args.new_tokens
    log(f"models/tiny fp32, prompt {ids.shape[1]}, {new} greedy tokens; torch {torch.__version__}, "
        f"transformers {transformers.__version__}")
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(config=model.config),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    log(f"  DynamicCache (sdpa)        {tok.decode(ref.tolist())!r}")
    kvslim.hf.prepare(model)
    for method, fields in (("full", {}), ("kivi8", {"kivi_bits": 8, "kivi_group_size": 32}), ("kivi2", {"kivi_bits": 2, "kivi_group_size": 32})):
        cfg = kvslim.Config(method="full" if method == "full" else "kivi", device="cuda", **fields)
        with torch.no_grad():
            eager = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   past_key_values=kvslim.hf.KVSlimCache(model, cfg), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        graph = kvslim.hf.GraphDecoder(model, kvslim.hf.KVSlimCache(model, cfg), ids.shape[1] + new).generate(ids, new)[0]
        same_e = int((eager == ref).sum())
        same_g = int((graph == ref).sum())
        first = next((i for i in range(new) if graph[i] != ref[i]), None)
        log(f"  kvslim {method:6s} eager: {same_e}/{new} tokens equal to DynamicCache's; graph: {same_g}/{new} "
            f"(first difference at {first}); graph = eager: {bool(torch.equal(graph, eager))}")
    kvslim.hf.restore(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
