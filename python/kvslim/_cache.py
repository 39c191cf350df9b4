"""Cache (one layer) and CacheSet (every layer of a model) over the C++ caches."""
from __future__ import annotations

import numpy as np

from . import _kvslim
from ._arrays import as_block, as_float32, as_positions, cuda_block, is_cuda_tensor, raw_stream
from ._config import Config


class StaleViewError(_kvslim.InputError):
    """A copy=False view read after its cache changed (update, append, observe, reset)."""


class View:
    """What a layer attends over: `tokens` rows per (batch, head), fp16.

    keys, values: [B, H_kv, T, D] float16; positions: [B, H_kv, T] int64 (the absolute position of
    every row; rows are NOT in position order after evictions). By default (copy=True) the arrays
    are the caller's own, copied inside the call that made them (with the GIL held, so another
    thread's call on the same cache cannot change them). With copy=False they alias the cache's
    storage: read-only and valid only until the next update/append/observe/reset of this cache
    (or a reset of its CacheSet); reading view.keys/values/positions after that raises
    StaleViewError instead of reading freed memory. An array taken out of such a view (k =
    view.keys) is not checked: keep the view, not its arrays, or use copy=True.
    """
    __slots__ = ("_keys", "_values", "_positions", "_cache", "_generation")

    def __init__(self, keys, values, positions, cache=None, generation=0):
        self._keys, self._values, self._positions = keys, values, positions
        self._cache, self._generation = cache, generation  # cache is None: the arrays are owned

    def _check(self):
        if self._cache is not None and self._cache._generation != self._generation:
            raise StaleViewError("a copy=False view was read after its cache changed (update, append, observe or "
                                 "reset); take a new view, or use copy=True")

    @property
    def keys(self) -> np.ndarray:
        self._check()
        return self._keys

    @property
    def values(self) -> np.ndarray:
        self._check()
        return self._values

    @property
    def positions(self) -> np.ndarray:
        self._check()
        return self._positions

    @property
    def tokens(self) -> int:
        return self._keys.shape[2]

    def __iter__(self):
        return iter((self.keys, self.values, self.positions))

    def __repr__(self) -> str:
        return f"kvslim.View(tokens={self.tokens}, {'aliasing the cache' if self._cache is not None else 'owned'})"

    def torch(self, device=None, dtype=None):
        """(keys, values, positions) as torch tensors (a copy when device or dtype changes)."""
        import torch
        k, v, p = (torch.from_numpy(np.ascontiguousarray(a)) for a in (self.keys, self.values, self.positions))
        if device is not None or dtype is not None:
            k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
            p = p.to(device=device)
        return k, v, p


def _view(arrays, cache, copy: bool) -> View:
    k, v, p = arrays  # copy=True: already copied by the binding, inside the call
    return View(k, v, p) if copy else View(k, v, p, cache, cache._generation)


class Stats(dict):
    """CacheStats as a dict with attribute access (stats.resident_bytes, stats["figures"])."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def figure(self, name: str) -> float:
        if name not in self["figures"]:
            raise KeyError(f'{self["method"]} cache has no figure "{name}"')
        return self["figures"][name]


def _reserve_tokens(tokens) -> int:
    """reserve()'s argument, checked: a non-negative int (not a bool)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise _kvslim.InputError(f"reserve: tokens must be a non-negative integer, got {tokens!r}")
    return tokens


class Cache:
    """One layer's cache. Cache(config) builds a lone cache; CacheSet[i] gives a model's layer i."""

    def __init__(self, config: Config | None = None, *, _core=None, _owner=None):
        if _core is None:
            _core = _kvslim.create_cache((config or Config())._c)
        self._core = _core
        self._owner = _owner  # the CacheSet a layer belongs to (keeps it alive)
        self._generation = 0  # bumped by every call that may move or free the storage (copy=False views)
        self._kv_heads = None  # KV heads of the last device append (sizes attend's probs without stats(), which waits)

    def _changed(self) -> None:
        self._generation += 1

    # -- the contract (today: update_and_fetch; see README "Python" for the append/attend move) --
    def update(self, keys, values, positions=None, *, copy: bool = True) -> View:
        """Absorbs a block [B, H_kv, S, D] of keys and values (numpy or torch; fp32, fp16 or bf16;
        a C-contiguous CPU input is read in place) at absolute `positions` (S increasing ints;
        None: continue after the last position) and returns the view to attend over."""
        k, kd = as_block(keys, "keys")
        v, vd = as_block(values, "values")
        if kd != vd:
            raise _kvslim.InputError(f"values: element type {v.dtype}/{vd or v.dtype} differs from keys' {k.dtype}/{kd or k.dtype}")
        self._changed()
        return _view(self._core.update_and_fetch(k, v, as_positions(positions), kd, bool(copy)), self, copy)

    # -- append + attend over the cache's own (compressed) storage, when the library has it: kvslim.has_attend() --
    def append(self, keys, values, positions=None) -> None:
        """Absorbs a block [B, H_kv, S, D] (as update) without materialising anything. A cache made
        with Config(device="cuda") takes torch CUDA tensors, read in place on torch's current stream."""
        self._need_attend("append")
        if is_cuda_tensor(keys) or is_cuda_tensor(values):
            k, kd, stream = cuda_block(keys, "keys")
            v, vd, _ = cuda_block(values, "values", stream=False)
            if kd != vd or k.shape != v.shape or k.device != v.device:
                raise _kvslim.InputError(f"values: {tuple(v.shape)} {v.dtype} on {v.device} differs from keys' "
                                         f"{tuple(k.shape)} {k.dtype} on {k.device}")
            self._core.append_device(k.data_ptr(), v.data_ptr(), list(k.shape), kd, as_positions(positions), stream)
            self._kv_heads = int(k.shape[1])
            return
        k, kd = as_block(keys, "keys")
        v, vd = as_block(values, "values")
        if kd != vd:
            raise _kvslim.InputError(f"values: element type {v.dtype}/{vd or v.dtype} differs from keys' {k.dtype}/{kd or k.dtype}")
        self._changed()
        self._core.append(k, v, as_positions(positions), kd)

    def attend(self, queries, query_positions, scale: float | None = None, probs: bool = False):
        """Attention of queries [B, S, H_q, D] (fp32; GQA: H_q a multiple of H_kv) over what the cache
        keeps, computed from its own storage, causal by absolute position. Returns (out fp32
        [B, S, H_q, D], probs fp32 [B, H_kv, S, rows()] summed over each KV group, or None); probs can
        be passed straight to observe_attention."""
        self._need_attend("attend")
        if is_cuda_tensor(queries):
            # Device caches: out (and probs) are allocated on the queries' GPU, nothing leaves it.
            q, out, p = self._device_call(queries, probs)
            self._core.attend_device(q.data_ptr(), list(q.shape), as_positions(query_positions, "query_positions"),
                                     0.0 if scale is None else float(scale), out.data_ptr(),
                                     0 if p is None else p.data_ptr(), raw_stream(q.device))
            return out, p
        return self._core.attend(as_float32(queries, "queries"), as_positions(query_positions, "query_positions"),
                                 0.0 if scale is None else float(scale), bool(probs))

    def attend_and_observe(self, queries, query_positions, scale: float | None = None):
        """attend(queries, query_positions, scale, probs=True), then observe_attention of those
        probabilities, for a caller that never reads them (a model's attention step); returns out
        fp32 [B, S, H_q, D]. A device cache's decode step may then score each row inside its
        observation from the attention's logits and write no probabilities at all; a cache that
        observes nothing attends without them."""
        self._need_attend("attend_and_observe")
        if is_cuda_tensor(queries):
            # (The probabilities' workspace of a captured step stays in the graph's pool.)
            q, out, p = self._device_call(queries, self._core.needs()["attention"], workspace=True)
            self._changed()
            self._core.attend_and_observe_device(q.data_ptr(), list(q.shape),
                                                 as_positions(query_positions, "query_positions"),
                                                 0.0 if scale is None else float(scale), out.data_ptr(),
                                                 0 if p is None else p.data_ptr(), 0 if p is None else p.shape[1],
                                                 raw_stream(q.device))
            return out
        queries, query_positions = as_float32(queries, "queries"), as_positions(query_positions, "query_positions")
        self._changed()
        return self._core.attend_and_observe(queries, query_positions, 0.0 if scale is None else float(scale))

    def _device_call(self, queries, with_probs: bool, workspace: bool = False):
        """A device attend's operands on the queries' GPU: queries as fp32 [B, S, H_q, D] (one
        conversion kernel at most), out of that shape, and probs [B, H_kv, S, rows()] or None
        (workspace: at least one column, so that an empty cache's still has an address)."""
        import torch
        q = queries.detach()
        if q.dtype != torch.float32 or not q.is_contiguous():  # one conversion kernel, not two
            q = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)
        if q.dim() != 4:
            raise _kvslim.InputError(f"queries: expected 4 dimensions [batch, tokens, heads, head_dim], got {q.dim()}")
        B, S = q.shape[0], q.shape[1]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        p = None
        if with_probs:
            heads = self._kv_heads or self._core.stats()["heads"]
            rows = self._core.rows()
            p = torch.empty((B, heads, S, max(rows, 1) if workspace else rows), dtype=torch.float32, device=q.device)
        return q, out, p

    def rows(self) -> int:
        """Rows kept per (batch, KV head)."""
        self._need_attend("rows")
        return self._core.rows()

    def _need_attend(self, what: str) -> None:
        if not _kvslim.has_attend:
            raise NotImplementedError(f"Cache.{what}: this kvslim build has the update_and_fetch contract only")

    def view(self, *, copy: bool = True) -> View:
        """The current view without absorbing anything."""
        self._changed()  # view() writes a compressed cache's scratch: a mutating call (kvslim/cache.h)
        return _view(self._core.view(bool(copy)), self, copy)

    materialize = view

    def stats(self) -> Stats:
        return Stats(self._core.stats())

    def reset(self) -> None:
        self._changed()
        self._core.reset()

    def reserve(self, tokens: int) -> None:
        """A hint: this layer will be given at most `tokens` tokens in all (prompt plus generated).
        A cache that keeps every token (full; kivi's codes on a GPU) then allocates once instead of
        growing (each growth copies the whole store) -- on a GPU at once when the cache's shape is
        known, which a captured decode step needs (kvslim.hf.GraphDecoder); bounded caches ignore it."""
        self._changed()
        self._core.reserve(_reserve_tokens(tokens))

    def needs(self) -> dict:
        """Which engine signals this cache uses: {"attention": bool, "hidden_states": bool,
        "attention_queries": int} (0: every query of a step is read; n: only a step's last n
        queries, so an integrator may observe just those)."""
        return self._core.needs()

    def observe_attention(self, probs, query_positions) -> None:
        """Attention of the last step over the view the last update returned: probs [B, H_kv, Q, T]
        (summed over the query heads of each KV group), query_positions [Q]."""
        if is_cuda_tensor(probs):
            # A device cache's own attend probs: handed over in place, on torch's current stream.
            import torch
            p = probs.detach()
            if p.dtype != torch.float32 or not p.is_contiguous() or p.dim() != 4:
                raise _kvslim.InputError(f"probs: expected a contiguous float32 [batch, kv_heads, queries, tokens] "
                                         f"tensor, got {p.dtype} {tuple(p.shape)}")
            self._changed()
            self._core.observe_attention_device(p.data_ptr(), list(p.shape), as_positions(query_positions, "query_positions"),
                                                raw_stream(p.device))
            return
        probs, query_positions = as_float32(probs, "probs"), as_positions(query_positions, "query_positions")
        self._changed()
        self._core.observe_attention(probs, query_positions)

    def observe_hidden(self, before, after) -> None:
        """Hidden states before and after the attention block (plus residual), [B, T, hidden]."""
        before, after = as_float32(before, "before"), as_float32(after, "after")
        self._changed()
        self._core.observe_hidden(before, after)

    @property
    def method(self) -> str:
        return self._core.method

    @property
    def layer_id(self) -> int:
        return self._core.layer_id

    def __repr__(self) -> str:
        s = self._core.stats()
        return f"kvslim.Cache({s['method']}, layer {self.layer_id}, {s['tokens_kept']} kept of {s['tokens_seen']})"


class CacheSet:
    """The caches of one model, one per layer (KVCacheBuilder::for_model): squeeze layers share a
    coordinator, pyramidkv layers get their taper, head_dim and seed are set per layer.

    CacheSet(config, num_layers=..., kv_heads=..., head_dim=...) for a uniform model, or
    CacheSet(config, layers=[(attention, kv_heads, head_dim), ...]); cs[i] is None for a layer
    without attention."""

    def __init__(self, config: Config, num_layers: int | None = None, kv_heads: int | None = None,
                 head_dim: int | None = None, *, layers=None):
        if layers is None:
            if None in (num_layers, kv_heads, head_dim):
                raise TypeError("CacheSet needs num_layers, kv_heads and head_dim, or layers=[...]")
            if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
                # [...] * -3 is an empty list: a set of 0 layers used to be built without a word.
                raise _kvslim.InputError(f"num_layers must be a positive integer, got {num_layers!r}")
            layers = [(True, kv_heads, head_dim)] * num_layers
        layers = list(layers)
        if not layers:
            raise _kvslim.InputError("layers: at least one layer is needed")
        spec = []
        for i, layer in enumerate(layers):
            attention, heads, dim = layer
            for what, value in (("kv_heads", heads), ("head_dim", dim)):
                if attention and (not isinstance(value, int) or value <= 0):
                    raise _kvslim.InputError(f"layers[{i}]: {what} must be a positive integer, got {value!r}")
            spec.append((bool(attention), int(heads), int(dim)))
        self._core = _kvslim.CacheSet(config._c, spec)
        self._spec = spec
        self._method = config.method
        self._rank_gather = None  # kvslim.distributed: kept alive here (C++ holds it too)
        self._layers = []
        for i in range(len(self._core)):
            core = self._core.layer(i)
            self._layers.append(None if core is None else Cache(_core=core, _owner=self))

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: int) -> Cache | None:
        return self._layers[i]

    def __iter__(self):
        return iter(self._layers)

    def reset(self) -> None:
        for c in self._layers:
            if c is not None:
                c._changed()
        self._core.reset()

    def set_rank_gather(self, gather) -> None:
        """Tensor parallelism: this set holds a slice of every layer's KV heads. `gather` (a
        kvslim.distributed.TensorParallel, or any _kvslim.RankGather) combines what a layer decides
        from all its heads; use kvslim.distributed.shard(), which checks the slices first."""
        self._core.set_rank_gather(gather)
        self._rank_gather = gather

    def reserve(self, tokens: int) -> None:
        """Cache.reserve(tokens) on every layer: the run's length, when the caller knows it."""
        for c in self._layers:
            if c is not None:
                c._changed()
        self._core.reserve(_reserve_tokens(tokens))

    def resident_bytes(self) -> int:
        """Bytes really allocated for the retained state, summed over layers."""
        return self._core.resident_bytes()

    def seen_fp16_bytes(self) -> int:
        """What every token seen would take as fp16 K+V, summed over layers."""
        return self._core.seen_fp16_bytes()

    def stats(self) -> list:
        return [None if c is None else c.stats() for c in self._layers]
