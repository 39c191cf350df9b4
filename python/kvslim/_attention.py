"""Attention over a kvslim cache's view, in torch, with the engine-side signals fed back.

Kept free of transformers so it is tested in CI (Debian's torch, no transformers); kvslim.hf wires
it into a model. Two ways to attend (LayerState's `attention`):
  "kvslim": the cache absorbs the step (append) and computes attention over its own storage
            (attend: fp16 slots, packed groups) -- nothing is materialised. Needs the attend
            contract (kvslim.has_attend()); the default where it exists.
  "torch":  the cache absorbs the step and hands back its fp16 view (update_and_fetch); attention
            runs here in torch, step for step as transformers' eager attention (so method "full"
            reproduces it bit for bit). Works with every build.
In "kvslim" mode a prompt's first call (the cache empty, S > 1) attends in torch's SDPA over the
step's own keys and values, before the cache compresses them (as KIVI's and transformers' quantized
caches do), since every row it could read is in that step; later calls attend over the cache.
A cache built for a GPU (Config(device="cuda")) keeps its rows in GPU memory: "kvslim" mode then
appends the step's CUDA tensors in place and attends with the cache's kernels on torch's current
stream, so nothing crosses to the host but a few positions.
"""
from __future__ import annotations

import numpy as np
import torch

from ._cache import Cache
from ._kvslim import has_attend

MODES = ("kvslim", "torch")


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * groups, T, D], query head h reading KV head h // groups."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


class LayerState:
    """One layer: its kvslim cache plus what the attention of the current step needs."""

    def __init__(self, cache: Cache, attention: str | None = None, device: str = "cpu"):
        if attention is None:
            attention = "kvslim" if has_attend else "torch"
        if attention not in MODES:
            raise ValueError(f"attention: {attention!r} is not one of {MODES}")
        if attention == "kvslim" and not has_attend:
            raise ValueError('attention="kvslim" needs the attend contract, which this kvslim build lacks; use "torch"')
        self.mode = attention
        self.on_device = device != "cpu"  # the cache's rows are in GPU memory (Config.device)
        if self.on_device and attention != "kvslim":
            raise ValueError(f'a cache on {device} attends with its own kernels: attention="kvslim", not {attention!r}')
        self.whole_prompt = False     # the last update was a prompt into an empty cache (SDPA attends it; "kvslim" mode)
        self.cache = cache
        self.seen = 0                 # next absolute position (tokens absorbed)
        self.view_positions = None    # [B, H_kv, T] int64 on the model's device, rows of the last view
        self.query_positions = None   # [S] int64: positions of the step's queries (= its new tokens)
        needs = cache.needs()
        self.wants_attention = needs["attention"]
        self.observed_queries = needs.get("attention_queries", 0)  # 0: every query of a step
        self.wants_hidden = needs["hidden_states"]
        self.attention_reports = self.hidden_reports = 0  # signals handed to the cache (diagnostics)

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None):
        """Absorbs the step's [B, H_kv, S, D] keys/values at `positions` (S ints; None: continue).
        "torch": returns the view as (keys, values) tensors on the inputs' device and dtype (owned
        copies: the cache's storage is not handed to the model). "kvslim": returns the inputs
        unchanged (attend reads the cache, not them)."""
        s = keys.shape[-2]
        if self.on_device:
            if positions is None or positions.is_cuda:
                # The step's positions from the layer's own count: reading transformers'
                # cache_position (a CUDA tensor, always seen .. seen + S - 1 without padding) would
                # stall the stream once per layer and step.
                pos = np.arange(self.seen, self.seen + s, dtype=np.int64)
            else:
                pos = positions.detach().to(dtype=torch.int64).reshape(-1).numpy()
            self.whole_prompt = self.seen == 0 and s > 1 and self.cache.rows() == 0
            self.cache.append(keys, values, pos)
            self.seen = int(pos[-1]) + 1
            self.query_positions = pos
            return keys, values
        if positions is None:
            positions = torch.arange(self.seen, self.seen + s, dtype=torch.int64)
        positions = positions.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if self.mode == "kvslim":
            self.whole_prompt = self.seen == 0 and s > 1 and self.cache.rows() == 0
            if keys.is_cuda:  # a host cache under a GPU model: the step's states cross to it
                self.cache.append(keys.detach().cpu(), values.detach().cpu(), positions.numpy())
            else:
                self.cache.append(keys, values, positions.numpy())
            self.seen = int(positions[-1]) + 1
            self.query_positions = positions
            return keys, values  # where the model has them (a prompt's first call attends them)
        view = self.cache.update(keys, values, positions.numpy(), copy=True)
        self.seen = int(positions[-1]) + 1
        self.query_positions = positions.to(keys.device)
        k, v, p = view.torch()
        self.view_positions = p.to(keys.device)
        return k.to(device=keys.device, dtype=keys.dtype), v.to(device=values.device, dtype=values.dtype)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None,
               dropout: float = 0.0, training: bool = False):
        """Causal attention of query [B, H_q, S, D] over the view (key/value [B, H_kv, T, D] from
        update). The arithmetic follows transformers' eager attention step for step (so method "full"
        reproduces it exactly); the causal mask comes from absolute positions because a compressed
        view's rows are not in position order. Returns (output [B, S, H_q, D], weights [B, H_q, S, T])."""
        if self.mode == "kvslim":
            return self._attend_in_cache(query, key, value, scaling)
        b, hq, s, d = query.shape
        hkv, t = key.shape[1], key.shape[2]
        if self.view_positions is None or self.view_positions.shape[-1] != t:
            raise RuntimeError("kvslim attention: key/value are not the view of this layer's last update")
        groups = hq // hkv
        scaling = d ** -0.5 if scaling is None else scaling
        weights = torch.matmul(query, repeat_kv(key, groups).transpose(2, 3)) * scaling
        allowed = self.view_positions[:, :, None, :] <= self.query_positions[None, None, :, None]  # [B, H_kv, S, T]
        if not bool(allowed.all()):
            mask = torch.zeros(allowed.shape, dtype=weights.dtype, device=weights.device)
            mask.masked_fill_(~allowed, torch.finfo(weights.dtype).min)
            weights = weights + repeat_kv(mask, groups)
        probs = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32)
        if self.wants_attention:
            # Summed over the query heads of each KV group: [B, H_kv, S, T], rows of the view.
            observed = probs.reshape(b, hkv, groups, s, t).sum(dim=2)
            self.cache.observe_attention(observed, self.query_positions)
            self.attention_reports += 1
        weights = probs.to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=training)
        out = torch.matmul(weights, repeat_kv(value, groups)).transpose(1, 2).contiguous()
        return out, weights

    def _attend_in_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None):
        # The cache's own kernels (fp32 arithmetic over its fp16/packed storage).
        if self.query_positions is None or query.shape[2] != self.query_positions.shape[0]:
            raise RuntimeError("kvslim attention: the queries are not those of this layer's last append")
        if self.whole_prompt:
            return self._attend_prompt(query, key, value, scaling), None
        out = self._attend_observing(self._cache_queries(query), scaling)
        if self.on_device:
            return out.to(query.dtype), None
        return torch.from_numpy(out).to(device=query.device, dtype=query.dtype), None

    def _cache_queries(self, query: torch.Tensor):
        """[B, H_q, S, D] model queries as the cache's attend takes them, [B, S, H_q, D]: in place for
        a device cache (Cache.attend converts to fp32 there), an fp32 host copy for a host cache."""
        if self.on_device:
            return query.transpose(1, 2)
        return query.detach().transpose(1, 2).to(device="cpu", dtype=torch.float32).contiguous()

    def _window(self, s: int) -> int:
        """How many of a call's last queries the cache reads (its observation window), of `s`."""
        return s if self.observed_queries <= 0 else min(self.observed_queries, s)

    def _attend_and_observe(self, q, pos, scaling: float | None):
        """The cache's attention of q at `pos`, which the cache observes: its probabilities are read
        by nobody else (a device cache's decode step may never write them)."""
        out = self.cache.attend_and_observe(q, pos, scaling)
        self.attention_reports += 1
        return out

    def _attend_observing(self, q, scaling: float | None):
        """The cache's attention of q [B, S, H_q, D] at the step's positions; a cache that scores by
        attention observes the probabilities of the queries it reads (its window), and only those
        are computed with probabilities -- a long chunk's [B, H_kv, S, rows] probabilities would
        cost more memory than its cache."""
        pos = self.query_positions
        s = q.shape[1]
        n = self._window(s)
        if not self.wants_attention:
            return self.cache.attend(q, pos, scaling)[0]
        if n == s:
            return self._attend_and_observe(q, pos, scaling)
        head, _ = self.cache.attend(q[:, : s - n], pos[: s - n], scaling)
        tail = self._attend_and_observe(q[:, s - n:], pos[s - n:], scaling)
        return (torch.cat if self.on_device else np.concatenate)([head, tail], 1)

    def _attend_prompt(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None):
        """A prompt's first call into an empty cache: causal SDPA in torch over the step's own keys and
        values (update returned them where the model has them: every row this prompt can see), before
        the cache's compression touches them, as KIVI, ZipCache and transformers' quantized caches
        run a prefill; host and device caches alike, so both paths answer the same."""
        groups = query.shape[1] // key.shape[1]
        k, v = repeat_kv(key, groups), repeat_kv(value, groups)
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        if sdpa is not None:
            out = sdpa(query, k, v, is_causal=True, scale=scaling)
        else:  # torch < 2.0 (Debian 12's): the same causal attention in eager arithmetic, fp32 softmax
            s = query.shape[2]
            weights = torch.matmul(query, k.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
            weights = weights.masked_fill(torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1),
                                          torch.finfo(weights.dtype).min)
            out = torch.matmul(torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype), v)
        if self.wants_attention:
            # An eviction cache scores the prompt by its last queries' attention over every row (its
            # observation window): the cache's own kernels attend just those queries, for their
            # probabilities, which it observes (on the device for a device cache).
            n = self._window(query.shape[2])
            self._attend_and_observe(self._cache_queries(query[:, :, -n:]), self.query_positions[-n:], scaling)
        return out.transpose(1, 2).contiguous()

    def observe_hidden(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Hidden states [B, T, hidden] before attention and after attention plus the residual."""
        self.cache.observe_hidden(before, after)
        self.hidden_reports += 1

    def reset(self) -> None:
        self.cache.reset()
        self.seen = 0
        self.whole_prompt = False
        self.view_positions = self.query_positions = None
