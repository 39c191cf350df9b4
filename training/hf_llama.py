"""A small, self-contained PyTorch re-implementation of Hugging Face's Llama / Qwen2
causal LM forward pass, plus safetensors and config.json I/O in HF's layout.

Why it exists: the shipped model and the golden files had to be made on a CPU-only
machine with Debian's python3-torch 1.13 and no `transformers`. Parameter names,
shapes, the file layout and the arithmetic follow transformers' modeling_llama.py /
modeling_qwen2.py (eager attention):
  * RMSNorm in fp32: x * rsqrt(mean(x^2) + eps), then weight * x.
  * RoPE "rotate_half" (NeoX) layout; cos/sin computed in fp32 from inv_freq;
    inv_freq = 1 / theta^(2i/d), with optional Llama-3.1 ("llama3") scaling.
  * GQA: query head h reads KV head h // (n_heads / n_kv_heads).
  * softmax in fp32, scale 1/sqrt(head_dim), causal mask.
  * MLP: down(silu(gate(x)) * up(x)); Qwen2 adds q/k/v biases; tied embeddings reuse
    embed_tokens for the output head (no lm_head.weight stored).
The loaders in training/make_golden.py can cross-check it against transformers when
that package is importable (--check-with-transformers).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    model_type: str = "llama"            # "llama" or "qwen2"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # q/k/v bias (Qwen2: True)
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def to_hf_json(self, dtype: str, style: str = "v4") -> dict:
        """config.json as transformers writes it. style "v4": rope_theta/rope_scaling/
        torch_dtype (transformers 4.x); "v5": rope_parameters/dtype (transformers 5.x)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d = {"architectures": [arch], "model_type": self.model_type,
             "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
             "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
             "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
             "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
             "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
             "tie_word_embeddings": self.tie_word_embeddings, "attention_dropout": 0.0,
             "initializer_range": 0.02, "use_cache": True,
             "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if self.model_type == "llama":
            d.update({"attention_bias": self.attention_bias, "mlp_bias": False, "pretraining_tp": 1})
        else:
            d.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": self.num_hidden_layers})
        if style == "v4":
            d["rope_theta"] = self.rope_theta
            d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
            d["torch_dtype"] = dtype
        else:
            params = {"rope_type": "default", "rope_theta": self.rope_theta}
            if self.rope_scaling:
                params.update(self.rope_scaling)
            d["rope_parameters"] = params
            d["dtype"] = dtype
        d.update(self.extra)
        return d

    @staticmethod
    def from_hf_json(d: dict) -> "Config":
        rope = d.get("rope_parameters")
        if rope:
            theta = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling.get("rope_type", "default") == "default":
                scaling = None
        else:
            theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
        mt = d["model_type"]
        return Config(model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                      intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                      num_attention_heads=d["num_attention_heads"],
                      num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                      head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                      max_position_embeddings=d["max_position_embeddings"], rms_norm_eps=d["rms_norm_eps"],
                      rope_theta=theta, rope_scaling=scaling,
                      tie_word_embeddings=d.get("tie_word_embeddings", False),
                      attention_bias=(mt == "qwen2") or d.get("attention_bias", False),
                      bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                      pad_token_id=d.get("pad_token_id"))


def rope_inv_freq(cfg: Config) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s or s.get("rope_type", s.get("type")) in (None, "default"):
        return inv
    if s.get("rope_type", s.get("type")) != "llama3":
        raise ValueError(f"rope_scaling type {s} is not supported here")
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / factor, inv)
    smooth = (old_ctx / wl - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    return torch.where(medium, smoothed, out)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=b)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        c = self.cfg
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)    # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)   # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv
        k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        scores = torch.matmul(q, k.transpose(2, 3)) * (hd ** -0.5) + mask   # [B, nh, T, T]
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, nh * hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names match HF: model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ..."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)                     # [T, hd]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (fp32 when the weights are fp32)."""
        B, T = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(torch.arange(T, device=input_ids.device), x.dtype)
        mask = torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w)


# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------
_DT = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DT_NP = {"F32": np.float32, "F16": np.float16}


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        raw = _raw_bytes(t)
        header[name] = {"dtype": _DT[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    data = Path(path).read_bytes()
    n = struct.unpack_from("<Q", data, 0)[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        buf = data[base + a:base + b]
        if meta["dtype"] == "BF16":
            t = torch.from_numpy(np.frombuffer(buf, dtype="<i2").copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(buf, dtype=_DT_NP[meta["dtype"]]).copy())
        out[name] = t.reshape(meta["shape"])
    return out


def hf_state_dict(model: CausalLM, dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items() if k != "inv_freq"}


def save_pretrained(model: CausalLM, out_dir: Path, dtype, *, shards: int = 1, config_style: str = "v4",
                    generation: dict | None = None) -> list[str]:
    """Writes config.json, generation_config.json (optional) and safetensors in HF's
    layout: one model.safetensors, or model-0000i-of-0000n.safetensors + index."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model, dtype)
    dname = _DT[dtype].lower().replace("f32", "float32").replace("f16", "float16").replace("bf16", "bfloat16")
    (out_dir / "config.json").write_text(json.dumps(model.cfg.to_hf_json(dname, config_style), indent=2) + "\n")
    if generation is not None:
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if shards == 1:
        write_safetensors(out_dir / "model.safetensors", sd)
        return ["model.safetensors"]
    # Greedy split in name order into `shards` files of about equal size.
    names = sorted(sd)
    sizes = [sd[n].numel() * sd[n].element_size() for n in names]
    target = sum(sizes) / shards
    groups, cur, acc = [], [], 0
    for n, s in zip(names, sizes):
        if cur and acc + s > target * 1.05 and len(groups) < shards - 1:
            groups.append(cur)
            cur, acc = [], 0
        cur.append(n)
        acc += s
    groups.append(cur)
    files, weight_map, total = [], {}, 0
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(out_dir / fname, {n: sd[n] for n in g})
        files.append(fname)
        weight_map.update({n: fname for n in g})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return files


def load_pretrained(model_dir: Path, dtype=torch.float32) -> CausalLM:
    """Loads a directory written by save_pretrained (or by transformers) and upcasts."""
    cfg = Config.from_hf_json(json.loads((model_dir / "config.json").read_text()))
    model = CausalLM(cfg)
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    sd = {}
    for f in files:
        sd.update(read_safetensors(model_dir / f))
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if m != "inv_freq"]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()
