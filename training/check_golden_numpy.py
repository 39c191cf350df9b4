#!/usr/bin/env python3
"""Independent check of tests/golden/models/*/golden.json: a second, deliberately
different implementation of the Llama/Qwen2 forward in plain NumPy (float64, explicit
per-head loops, RoPE written as rotations of the (i, i + d/2) pairs, its own safetensors
parser and config reader) must reproduce the committed fp32 logits.

    /usr/bin/python3 training/check_golden_numpy.py      (needs python3-numpy only)
"""
from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "models"


def read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        data = (model_dir / name).read_bytes()
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            raw = data[8 + n + a:8 + n + b]
            if meta["dtype"] == "BF16":
                arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            elif meta["dtype"] == "F16":
                arr = np.frombuffer(raw, dtype="<f2")
            elif meta["dtype"] == "F32":
                arr = np.frombuffer(raw, dtype="<f4")
            else:
                raise ValueError(f"{name}:{key}: dtype {meta['dtype']}")
            out[key] = arr.astype(np.float64).reshape(meta["shape"])
    return out


def inv_freq(cfg: dict, head_dim: int) -> np.ndarray:
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"} if rp else None)
    freqs = np.array([theta ** (-(2.0 * i) / head_dim) for i in range(head_dim // 2)])
    if not scaling or scaling.get("rope_type") in (None, "default"):
        return freqs
    assert scaling["rope_type"] == "llama3"
    f, lo, hi, old = (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                      scaling["original_max_position_embeddings"])
    out = []
    for w in freqs:
        wavelen = 2 * math.pi / w
        if wavelen < old / hi:          # high frequency: unchanged
            out.append(w)
        elif wavelen > old / lo:        # low frequency: divided by factor
            out.append(w / f)
        else:                           # in between: interpolate
            s = (old / wavelen - lo) / (hi - lo)
            out.append((1 - s) * w / f + s * w)
    return np.array(out)


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def forward(model_dir: Path, ids: list[int]) -> np.ndarray:
    cfg = json.loads((model_dir / "config.json").read_text())
    W = read_tensors(model_dir)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    freqs = inv_freq(cfg, hd)
    half = hd // 2

    def rope(v, pos):                    # v: [hd]
        out = v.copy()
        for i in range(half):
            c, s = math.cos(pos * freqs[i]), math.sin(pos * freqs[i])
            out[i] = v[i] * c - v[i + half] * s
            out[i + half] = v[i + half] * c + v[i] * s
        return out

    x = W["model.embed_tokens.weight"][ids]                       # [T, hidden]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        if p + "self_attn.q_proj.bias" in W:
            q, k, v = q + W[p + "self_attn.q_proj.bias"], k + W[p + "self_attn.k_proj.bias"], v + W[p + "self_attn.v_proj.bias"]
        attn = np.zeros((T, nh * hd))
        for head in range(nh):
            kvh = head // (nh // nkv)
            qs = np.stack([rope(q[t, head * hd:(head + 1) * hd], t) for t in range(T)])
            ks = np.stack([rope(k[t, kvh * hd:(kvh + 1) * hd], t) for t in range(T)])
            vs = v[:, kvh * hd:(kvh + 1) * hd]
            for t in range(T):
                s = qs[t] @ ks[:t + 1].T / math.sqrt(hd)
                s = np.exp(s - s.max())
                attn[t, head * hd:(head + 1) * hd] = (s / s.sum()) @ vs[:t + 1]
        x = x + attn @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    if cfg.get("tie_word_embeddings"):
        assert "lm_head.weight" not in W
    return x @ head.T


def main() -> int:
    worst = 0.0
    for name in ("llama_gqa", "qwen2_tied", "llama_f32"):
        d = GOLDEN / name
        golden = json.loads((d / "golden.json").read_text())
        want = np.array(golden["logits"])
        got = forward(d, golden["input_ids"])
        err = float(np.abs(got - want).max())
        rel = err / float(np.abs(want).max())
        print(f"{name}: max |numpy - golden| = {err:.2e} (relative to max |logit| {rel:.2e})")
        freq_err = float(np.abs(inv_freq(json.loads((d / 'config.json').read_text()),
                                         len(golden["rope_inv_freq"]) * 2) - np.array(golden["rope_inv_freq"])).max())
        print(f"{name}: max |inv_freq difference| = {freq_err:.2e}")
        worst = max(worst, rel)
    if worst > 1e-5:
        print("FAILED")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
