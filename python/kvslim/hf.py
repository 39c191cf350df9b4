"""kvslim.hf: Hugging Face transformers (5.x) Llama-family models generating through kvslim caches.

    import kvslim, kvslim.hf
    kvslim.hf.prepare(model)                                   # attention runs over kvslim's views
    cache = kvslim.hf.KVSlimCache(model, kvslim.Config(method="squeeze", squeeze_budget=128))
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.resident_bytes()

What goes where:
  * KVSlimCache (a transformers Cache) holds one kvslim cache per layer (kvslim.CacheSet, so squeeze
    layers share their coordinator). Its layers absorb each step's RoPE'd keys/values at their
    absolute positions; the kept state lives in kvslim's CPU memory (resident_bytes()), the model
    never holds a copy between steps.
  * The attention function registered as "kvslim" (AttentionInterface) runs the layer's attention
    through its cache, causal by absolute position (a compressed cache's rows are not in position
    order): attention="kvslim" (default when the library has the attend contract) lets the cache
    compute it over its own compressed storage; attention="torch" attends in torch over the fp16
    view (eager arithmetic: "full" reproduces DynamicCache bit for bit). Either way attention
    probabilities reach the caches that score with them (h2o/squeeze/pyramidkv with
    evict_scoring="attention*", zipcache with zipcache_saliency="attention_normalized").
  * prepare() also hooks every decoder layer so caches that use hidden states (squeeze_signal=
    "hidden_cosine") get the residual stream before and after attention during prefill.
  * On a GPU, build the cache there: KVSlimCache(model, kvslim.Config(method="kivi", device="cuda"))
    (methods with a device storage: kvslim.method_info(name)["cuda"]). Keys and values then never
    leave the GPU: each step's states are appended in place, decode attention runs in kvslim's CUDA
    kernels over the packed codes on torch's current stream, and the prompt's first call attends in
    torch's SDPA before the cache compresses it. A CPU cache under a GPU model works too, with the
    step's keys/values copied to the host and the attention output back every step.
  * Tensor parallel: under a model loaded with from_pretrained(..., tp_plan="auto") each rank's
    KVSlimCache holds that rank's slice of every layer's KV heads and is sharded over the model's
    "tp" process group when built (kvslim.distributed): every rank builds it, with the same config.
  * GraphDecoder(model, cache, max_tokens) decodes a GPU cache (full, kivi, zipcache, h2o, pyramidkv, squeeze,
    streaming, and eviction over kivi or zipcache codes) with one CUDA graph
    replay per step instead of transformers' eager forward (host-bound on the GPU): the step is
    captured once, kvslim's kernels re-armed from the caches' state before each replay.
Limits: batches without padding (one sequence, or equal lengths), no beam search (reorder), no
sliding-window layers.
Needs torch >= 2.0 (layer hooks with keyword arguments) and transformers >= 5.
"""
from __future__ import annotations

import torch

from ._arrays import raw_stream
from ._attention import LayerState
from ._cache import CacheSet
from ._config import Config

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("kvslim.hf needs transformers >= 5 (transformers.cache_utils.CacheLayerMixin)") from e

ATTENTION_NAME = "kvslim"


class KVSlimLayer(CacheLayerMixin):
    """One layer of a KVSlimCache: a kvslim cache behind transformers' layer interface."""

    is_compileable = False
    is_sliding = False

    def __init__(self, state: LayerState):
        super().__init__()
        self.state = state
        # keys/values stay None: the kept state is kvslim's; views are handed out per step only.

    def lazy_initialization(self, key_states, *args, **kwargs):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        positions = (cache_kwargs or {}).get("cache_position")
        keys, values = self.state.update(key_states, value_states, positions)
        keys._kvslim_state = self.state  # how the attention function finds the layer
        return keys, values

    def get_seq_length(self, *args) -> int:
        return self.state.seen

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        # query: the query length (transformers >= 5) or the cache_position tensor (4.5x).
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.state.seen + q, 0

    def get_max_cache_shape(self, *args) -> int:
        return -1  # no fixed shape: the method decides what stays

    def get_max_length(self, *args) -> int:  # abstract in transformers 5.17
        return -1

    def reset(self) -> None:
        self.state.reset()

    def offload(self):  # the state lives in kvslim's own storage (host or device), not in torch tensors
        pass

    def prefetch(self):
        pass

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("kvslim caches cannot be cropped (assisted decoding / contrastive search)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("kvslim caches do not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("kvslim caches cannot be expanded along the batch (num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("kvslim caches cannot select batch rows")


_missing = sorted(getattr(KVSlimLayer, "__abstractmethods__", ()))
if _missing:  # a transformers release that asks more of a cache layer than this file knows
    import transformers as _tf

    raise ImportError(f"kvslim.hf: transformers {_tf.__version__}'s CacheLayerMixin also requires {', '.join(_missing)}; "
                      "kvslim.hf does not implement it yet")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class KVSlimCache(Cache):
    """A transformers Cache whose layers are kvslim caches, built for `model` (or its config).
    attention: "kvslim" (the caches' own attention over compressed storage) or "torch" (over the
    materialised fp16 view); None picks "kvslim" where the library has it."""

    def __init__(self, model_or_config, config: Config, attention: str | None = None):
        hf = _text_config(getattr(model_or_config, "config", model_or_config))
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(f"kvslim.hf supports full-attention layers only, got {sorted(set(layer_types))}")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        self.kvslim_config = config  # (not `config`: transformers' Cache may use that name)
        # Tensor parallel (from_pretrained(..., tp_plan="auto")): this rank's attention sees only its
        # slice of the heads, so its caches hold that slice and agree with the other ranks' on
        # what a layer decides from all of its heads (kvslim.distributed, docs/distributed.md).
        from .distributed import model_layout, shard
        self.tp_layout = model_layout(model_or_config, kv_heads, heads) if hasattr(model_or_config, "config") else None
        local_kv = kv_heads if self.tp_layout is None else self.tp_layout.stop - self.tp_layout.start
        self.query_heads = heads if self.tp_layout is None else self.tp_layout.q_stop - self.tp_layout.q_start
        self.kvslim = CacheSet(config, num_layers=len(layer_types), kv_heads=local_kv, head_dim=head_dim)
        self.rank_gather = None if self.tp_layout is None else \
            shard(self.kvslim, self.tp_layout.head_slice, kv_heads, self.tp_layout.group)  # a collective of the tp group
        device = str(getattr(config, "device", "cpu"))
        states = [LayerState(c, attention, device) for c in self.kvslim]
        self.attention = states[0].mode if states else attention
        super().__init__(layers=[KVSlimLayer(st) for st in states])

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query, layer_idx: int = 0, *args) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query)

    def reset(self) -> None:
        self.kvslim.reset()
        for layer in self.layers:
            layer.state.seen = 0
            layer.state.view_positions = layer.state.query_positions = None

    def resident_bytes(self) -> int:
        """Bytes kvslim really holds for the kept K/V of every layer."""
        return self.kvslim.resident_bytes()

    def seen_fp16_bytes(self) -> int:
        """What a full fp16 cache of every token seen would take."""
        return self.kvslim.seen_fp16_bytes()

    def stats(self) -> list:
        return self.kvslim.stats()

    def signal_reports(self) -> dict:
        """How many attention / hidden-state observations reached the caches (summed over layers)."""
        return {"attention": sum(l.state.attention_reports for l in self.layers),
                "hidden_states": sum(l.state.hidden_reports for l in self.layers)}


class GraphDecoder:
    """Decode steps of `model` over a GPU KVSlimCache, each run as one CUDA graph replay.

    transformers' eager forward spends milliseconds of Python and kernel launches per step, more
    than the GPU needs for a compressed cache's attention (docs/cuda.md). GraphDecoder captures one
    decode step -- the model's kernels and kvslim's -- with torch.cuda.CUDAGraph; every later step
    is one graph launch, before which the caches set their kernels' arguments from their own state
    (rows, kivi's window and groups, positions: kvslim's StepGraph) and the step's token ids and
    position are copied into the graph's inputs.

        kvslim.hf.prepare(model)
        cache = kvslim.hf.KVSlimCache(model, kvslim.Config(method="kivi", kivi_bits=2, device="cuda"))
        dec = kvslim.hf.GraphDecoder(model, cache, max_tokens=prompt_len + new)
        tokens = dec.generate(prompt_ids, new)   # greedy: [B, new]
        # or, after a prefill of your own: logits = dec.step(next_ids)   # [B, 1, vocab]

    Caches "full", "kivi", "zipcache", "h2o", "pyramidkv", "squeeze" and "streaming" (over fp16 or
    kivi codes) on the GPU (an eviction cache once it holds its budget: from then on every step
    evicts one row on the device), one token per sequence per step, batches without padding.
    The first step runs eagerly (lazy initialisation stays out of the graph), the second is
    captured and runs, later ones replay -- except a step a cache decides on the host before it
    attends (streaming over kivi codes compressing its window: once every kivi_staging steps), which
    runs eagerly (eager_steps counts them). step()'s logits live in the graph's output buffer: the
    next step overwrites them. Needs torch's CUDAGraph(keep_graph=True) (torch >= 2.7)."""

    def __init__(self, model, cache: "KVSlimCache", max_tokens: int):
        if not isinstance(cache, KVSlimCache):
            raise TypeError("GraphDecoder replays a kvslim.hf.KVSlimCache")
        if not cache.layers or not all(layer.state.on_device for layer in cache.layers):
            raise ValueError('GraphDecoder replays caches in GPU memory: kvslim.Config(..., device="cuda")')
        if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
            raise ValueError("GraphDecoder: call kvslim.hf.prepare(model) first (the model attends through its cache)")
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int (prompt plus generated tokens), got {max_tokens!r}")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.heads = cache.query_heads  # this rank's query heads (all of them without tensor parallelism)
        self.steps = 0                         # steps run by step()
        self.eager_steps = 0                   # steps after the first run eagerly (next_step_replays said no)
        self._graph = self._step_graph = None  # torch's CUDAGraph (keeps its pool and cudaGraph_t alive), kvslim's StepGraph
        self._ids = self._position = self._logits = None

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step: input_ids [B, 1] (the last tokens) on the GPU -> logits [B, 1, vocab]."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1 or not input_ids.is_cuda:
            raise ValueError(f"GraphDecoder.step takes [batch, 1] token ids on the GPU, got {tuple(input_ids.shape)} "
                             f"on {input_ids.device}")
        seen = self.cache.get_seq_length()
        if seen == 0:
            raise ValueError("GraphDecoder.step decodes after a prompt: run the prompt through the model first")
        if seen + 1 > self.max_tokens:
            raise ValueError(f"GraphDecoder: step {seen + 1} exceeds max_tokens={self.max_tokens}")
        with torch.no_grad():
            if self.steps == 0:  # eager: lazy initialisation (cuBLAS handles, kernel attributes) outside any capture
                self.cache.kvslim.reserve(self.max_tokens)  # the capacity a captured step may not allocate
                logits = self._eager(input_ids, seen)
            elif not self._kv_graph().next_step_replays(raw_stream(input_ids.device)):
                # A step the caches decide on the host before they attend (streaming over kivi codes
                # compressing its window, once every kivi_staging steps): eager, as its CPU twin.
                logits = self._eager(input_ids, seen)
                self.eager_steps += 1
            elif self._graph is None:
                logits = self._capture(input_ids, seen)
            else:
                self._ids.copy_(input_ids)
                self._position.fill_(seen)  # cache_position and position_ids (a view of it)
                self._step_graph.replay(raw_stream(input_ids.device))
                for layer in self.cache.layers:  # Python's mirror of the caches' positions (capture ran it once)
                    layer.state.seen += 1
                logits = self._logits
        self.steps += 1
        return logits

    def _eager(self, input_ids: torch.Tensor, seen: int) -> torch.Tensor:
        return self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                          cache_position=torch.tensor([seen], device=input_ids.device)).logits

    def _kv_graph(self):
        """kvslim's StepGraph over the layers' caches (made once, captured at the first step it may)."""
        if self._step_graph is None:
            from ._kvslim import StepGraph
            self._step_graph = StepGraph([layer.state.cache._core for layer in self.cache.layers])
        return self._step_graph

    def _capture(self, input_ids: torch.Tensor, seen: int) -> torch.Tensor:
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError as e:
            raise RuntimeError(f"GraphDecoder needs torch.cuda.CUDAGraph(keep_graph=True) (torch >= 2.7), "
                               f"torch {torch.__version__} has no such argument") from e
        self._ids = input_ids.clone()
        self._position = torch.full((1,), seen, dtype=torch.long, device=input_ids.device)
        # Both passed as tensors: a position the model derived from the cache's length on the host
        # would be a constant of the graph (RoPE at the captured position in every replay).
        positions = self._position.view(1, 1).expand(input_ids.shape[0], 1)
        step_graph = self._kv_graph()
        step_graph.begin_capture(self.heads, 1)
        # The captured step counts as run: the caches and the layers' positions advance as in an
        # eager step, and the first replay runs its kernels. Captured on a side stream (as
        # torch.cuda.graph does) but without its gc.collect() and empty_cache(): with tens of GB of
        # a long prompt's blocks cached, those cost more than many steps. relaxed: kvslim checks
        # its inputs' pointers (cudaPointerGetAttributes) while capturing.
        device = input_ids.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="relaxed")
            try:
                out = self.model(input_ids=self._ids, past_key_values=self.cache, use_cache=True,
                                 cache_position=self._position, position_ids=positions)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        step_graph.end_capture(graph.raw_cuda_graph())
        self._graph, self._logits = graph, out.logits
        step_graph.replay(raw_stream(input_ids.device))
        return self._logits

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the prompt input_ids [B, T] (eager prefill into the empty cache), then
        max_new_tokens - 1 graph steps. Returns the new tokens [B, max_new_tokens]."""
        if self.cache.get_seq_length() != 0:
            raise ValueError("GraphDecoder.generate starts from an empty cache (reset() it, or use step())")
        if input_ids.shape[1] + max_new_tokens > self.max_tokens:
            raise ValueError(f"prompt {input_ids.shape[1]} + {max_new_tokens} new tokens exceed max_tokens={self.max_tokens}")
        with torch.no_grad():
            logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        nxt = logits[:, -1:].argmax(-1)
        out = [nxt]
        for _ in range(max_new_tokens - 1):
            nxt = self.step(nxt)[:, -1:].argmax(-1)
            out.append(nxt)
        return torch.cat(out, dim=1)


def kvslim_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "kvslim" attention implementation: attention over the layer's kvslim view.

    Signature of transformers' attention interface; returns (output [B, S, H, D], weights)."""
    state = getattr(key, "_kvslim_state", None)
    if state is None:
        raise RuntimeError("kvslim attention runs over a kvslim.hf.KVSlimCache: pass past_key_values="
                           "KVSlimCache(model, config) (or kvslim.hf.restore(model) for the model's own attention)")
    return state.attend(query, key, value, scaling=scaling, dropout=dropout, training=module.training)


def _kvslim_mask(*args, attention_mask=None, cache_position=None, **kwargs):
    # The causal mask is built from absolute positions inside kvslim_attention; only padding would
    # need one from here, and padded batches are not supported. Checked on a prompt's call (several
    # new tokens): the check reads the mask on the host, a stall of the GPU's queue that a one-token
    # decode step (whose mask only appends ones in generate) should not pay.
    one_token = cache_position is not None and cache_position.numel() == 1
    if attention_mask is not None and attention_mask.dim() == 2 and not one_token and not bool(attention_mask.all()):
        raise NotImplementedError("kvslim.hf: padded batches are not supported (one sequence or equal lengths)")
    return None


def register() -> None:
    """Registers the "kvslim" attention (and its mask hook) with transformers. Idempotent."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, kvslim_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older layouts build masks without a registry
        return
    AttentionMaskInterface.register(ATTENTION_NAME, _kvslim_mask)


def _set_attention(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _decoder_layers(model):
    for path in ("model.layers", "model.model.layers", "model.decoder.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise NotImplementedError(f"kvslim.hf: cannot find the decoder layers of {type(model).__name__}")


def _layer_cache(kwargs, idx):
    cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
    if isinstance(cache, KVSlimCache) and idx < len(cache.layers):
        return cache.layers[idx].state
    return None


def prepare(model):
    """Makes `model` attend through kvslim caches: registers the attention, switches the model to it
    and hooks its decoder layers for the hidden-state signal. Returns the model. Undo: restore()."""
    register()
    if not hasattr(model, "_kvslim_previous_attention"):
        model._kvslim_previous_attention = model.config._attn_implementation
        model._kvslim_hooks = []
        for idx, layer in enumerate(_decoder_layers(model)):
            model._kvslim_hooks += _hook_hidden_states(layer, idx)
    _set_attention(model, ATTENTION_NAME)
    return model


def restore(model):
    """Undoes prepare(): the model's previous attention implementation, hooks removed."""
    if hasattr(model, "_kvslim_previous_attention"):
        _set_attention(model, model._kvslim_previous_attention)
        for h in model._kvslim_hooks:
            h.remove()
        del model._kvslim_previous_attention, model._kvslim_hooks
    return model


def _hook_hidden_states(layer, idx):
    # The residual stream entering the decoder layer, and after attention plus the residual add
    # (= input + self_attn output), as the engine reports them; prefill steps only.
    captured = {}

    def before(module, args, kwargs):
        state = _layer_cache(kwargs, idx)
        captured.clear()
        if state is not None and state.wants_hidden:
            captured["x"] = args[0] if args else kwargs["hidden_states"]
            captured["state"] = state

    def after(module, args, kwargs, output):
        state = captured.pop("state", None)
        x = captured.pop("x", None)
        if state is None or x.shape[1] < 2:  # decode steps: the engine observes prefill only
            return
        attn = output[0] if isinstance(output, tuple) else output
        state.observe_hidden(x.float(), (x + attn).float())

    return [layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.self_attn.register_forward_hook(after, with_kwargs=True)]
