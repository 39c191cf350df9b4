"""Tensor parallelism on the CPU: 2 ranks (torch.distributed, gloo), each a CacheSet over half of
the KV heads, against one process over all heads (kvslim.distributed; docs/distributed.md).

Every rank feeds the same prompt and decode steps (the full tensors sliced by head) and scores with
the attention of its own view, as a tensor-parallel model would. Checked per method: per-layer
budgets equal on both ranks and equal to the 1-process run; each rank's kept rows (positions and
keys) per head equal the 1-process run's rows of those heads; where the kept set is the layer's
(full, kivi, zipcache) both ranks keep the same positions; resident bytes within 1 %. The same
ranks WITHOUT the agreement must differ from the 1-process run for squeeze and h2o: the data makes
the agreement matter, so these tests fail when it is switched off. The sharded runs take their
slice and process group from kvslim.distributed.model_layout of a model as transformers' tensor
parallelism leaves it (model._tp_size, model._device_mesh), as kvslim.hf.KVSlimCache does.
"""
import os
import pickle
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import kvslim  # noqa: E402

WORLD, LAYERS, HEADS, DIM, BATCH = 2, 4, 4, 16, 1
PROMPT, DECODE = 96, 6

# Budgets well under the prompt so that eviction happens; squeeze's signals each go through a
# different reduction (per-head mean, rank 0's first head, the global top-k's merged scores).
METHODS = {
    "full": dict(method="full"),
    "kivi": dict(method="kivi", kivi_staging=32, kivi_group_size=32),
    "zipcache": dict(method="zipcache", zipcache_staging=32, zipcache_group_size=32, zipcache_saliency="attention_normalized"),
    "streaming": dict(method="streaming", streaming_budget=40, streaming_n_sink=4),
    "h2o": dict(method="h2o", h2o_budget=40),
    "pyramidkv": dict(method="pyramidkv", pyramidkv_budget=40),
    "squeeze": dict(method="squeeze", squeeze_budget=40),
    "squeeze_entropy": dict(method="squeeze", squeeze_budget=40, squeeze_signal="attention_entropy"),
    "squeeze_coverage": dict(method="squeeze", squeeze_budget=40, squeeze_signal="attention_coverage"),
    "squeeze_hidden": dict(method="squeeze", squeeze_budget=40, squeeze_signal="hidden_cosine"),
    "squeeze_eager": dict(method="squeeze", squeeze_budget=40, squeeze_prefill="eager"),
    "squeeze_first_head": dict(method="squeeze", squeeze_budget=40, squeeze_concentration_heads="first"),
    "squeeze_global_topk": dict(method="squeeze", squeeze_budget=40, squeeze_signal="global_topk"),
    # Without the cross-layer board: the schedule's agreement alone decides the budgets.
    "squeeze_layers_alone": dict(method="squeeze", squeeze_budget=40, evict_cross_layer=0),
    "squeeze_global_topk_layers_alone": dict(method="squeeze", squeeze_budget=40, squeeze_signal="global_topk",
                                             evict_cross_layer=0),
}
PER_LAYER_KEPT = {"full", "kivi", "zipcache", "streaming"}  # every head keeps the same positions
MUST_DIFFER_ALONE = {"h2o", "squeeze", "squeeze_global_topk", "squeeze_layers_alone",
                     "squeeze_global_topk_layers_alone"}  # without the agreement


def _data():
    """[layer] of (keys, values, queries) [B, H, PROMPT + DECODE, D]: heads and layers of different
    concentration (a shared direction of weight growing with the layer and the head)."""
    rng = np.random.default_rng(29)
    out = []
    for layer in range(LAYERS):
        direction = rng.standard_normal(DIM).astype(np.float32)
        weight = np.array([0.3 * layer + 0.6 * h for h in range(HEADS)], dtype=np.float32)[None, :, None, None]
        shape = (BATCH, HEADS, PROMPT + DECODE, DIM)
        keys = rng.standard_normal(shape).astype(np.float32) + weight * direction
        values = rng.standard_normal(shape).astype(np.float32)
        queries = 2.0 * rng.standard_normal(shape).astype(np.float32)
        out.append((keys, values, queries))
    return out


def _probs(view, queries, query_positions):
    """Attention of queries [B, H, Q, D] over the view, head by head (the same arithmetic for a
    head wherever it lives), causal by position: [B, H, Q, T] float32."""
    keys = view.keys.astype(np.float32)
    positions = view.positions
    B, H, T, _ = keys.shape
    probs = np.zeros((B, H, len(query_positions), T), dtype=np.float32)
    for b in range(B):
        for h in range(H):
            logits = queries[b, h] @ keys[b, h].T / np.float32(np.sqrt(DIM))
            logits[positions[b, h][None, :] > query_positions[:, None]] = -np.inf
            logits -= logits.max(axis=1, keepdims=True)
            e = np.exp(logits)
            probs[b, h] = e / e.sum(axis=1, keepdims=True)
    return probs


def _run(spec, heads, shard=None):
    """Prompt then DECODE steps through a CacheSet over `heads` (a slice); returns per layer the
    budget, the kept positions and keys per head, and the set's resident bytes."""
    caches = kvslim.CacheSet(kvslim.Config(**spec), num_layers=LAYERS, kv_heads=heads.stop - heads.start, head_dim=DIM)
    if shard is not None:
        shard(caches)
    data = _data()
    steps = [(0, PROMPT)] + [(PROMPT + i, PROMPT + i + 1) for i in range(DECODE)]
    for first, last in steps:
        positions = np.arange(first, last, dtype=np.int64)
        for layer, (keys, values, queries) in enumerate(data):
            cache = caches[layer]
            view = cache.update(np.ascontiguousarray(keys[:, heads, first:last]),
                                np.ascontiguousarray(values[:, heads, first:last]), positions)
            if cache.needs()["attention"]:
                cache.observe_attention(_probs(view, queries[:, heads, first:last], positions), positions)
            if cache.needs()["hidden_states"]:
                # Hidden states are whole on every rank under tensor parallelism: the same arrays.
                hidden = np.random.default_rng(layer).standard_normal((2, BATCH, last - first, 32)).astype(np.float32)
                cache.observe_hidden(hidden[0], hidden[0] + (0.2 + 0.3 * layer) * hidden[1])
    result = {"bytes": caches.resident_bytes(), "layers": []}
    for layer in range(LAYERS):
        stats, view = caches[layer].stats(), caches[layer].view()
        budget = stats["figures"].get("layer_budget")
        result["layers"].append({"budget": budget, "positions": view.positions.copy(), "keys": view.keys.copy(),
                                 "concentration": stats["figures"].get("concentration")})
    return result


class _Mesh:
    """What kvslim reads of a torch DeviceMesh (torch 1.13 has none): dimension names, ndim, the
    "tp" sub-mesh and its process group."""

    def __init__(self, names, group, ndim=None):
        self.mesh_dim_names, self.group = names, group
        self.ndim = ndim if ndim is not None else max(1, len(names or ()))

    def __getitem__(self, name):
        assert name == "tp", name
        return _Mesh(("tp",), self.group)

    def get_group(self):
        return self.group


class _Model:
    """What transformers' from_pretrained(..., tp_plan="auto") leaves on a model for kvslim."""

    def __init__(self, tp_size, mesh):
        self._tp_size, self._device_mesh = tp_size, mesh
        self.config = None


def _layouts(kd):
    """model_layout of layouts a tensor-parallel transformers model can have, and of ones that do not
    fit: each a repr or the error's text."""
    out = {}
    cases = {
        "one_device": (_Model(None, None), 4, 8),
        "tp_1": (_Model(1, _Mesh(("tp",), None)), 4, 8),
        "flat_mesh": (_Model(WORLD, _Mesh(None, None, ndim=1)), 4, 8),
        "no_mesh": (_Model(WORLD, None), 8, 32),
        "odd_kv_heads": (_Model(WORLD, _Mesh(("tp",), None)), 3, 6),
        "odd_heads": (_Model(WORLD, _Mesh(("tp",), None)), 2, 3),
        "size_mismatch": (_Model(2 * WORLD, _Mesh(("tp",), None)), 8, 8),
        "no_tp_dim": (_Model(WORLD, _Mesh(("dp", "fsdp"), None)), 4, 8),
    }
    for name, (model, kv_heads, heads) in cases.items():
        try:
            out[name] = repr(kd.model_layout(model, kv_heads, heads))
        except kvslim.InputError as e:
            out[name] = "error: " + str(e)
    return out


def _worker(rank, store_path, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    import kvslim.distributed as kd
    per_rank = HEADS // WORLD
    heads = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {"errors": {}}
    # Bad slices are refused on every rank, naming them: overlapping, and not reaching the last head.
    for name, bad in (("overlap", (0, per_rank)), ("short", (rank, rank + 1))):
        caches = kvslim.CacheSet(kvslim.Config(method="squeeze", squeeze_budget=40), num_layers=LAYERS,
                                 kv_heads=bad[1] - bad[0], head_dim=DIM)
        try:
            kd.shard(caches, bad, HEADS)
            out["errors"][name] = None
        except kvslim.InputError as e:
            out["errors"][name] = str(e)
    # A set that already took tokens on one rank: refused on both (neither waits for the other).
    caches = kvslim.CacheSet(kvslim.Config(method="h2o", h2o_budget=40), num_layers=LAYERS, kv_heads=per_rank, head_dim=DIM)
    if rank == 1:
        block = np.zeros((BATCH, per_rank, 2, DIM), dtype=np.float32)
        caches[0].update(block, block)
    try:
        kd.shard(caches, (heads.start, heads.stop), HEADS)
        out["errors"]["used"] = None
    except kvslim.InputError as e:
        out["errors"]["used"] = str(e)
    out["layouts"] = _layouts(kd)
    # The sharded runs take their slice and group from a model's layout, as kvslim.hf.KVSlimCache does.
    layout = kd.model_layout(_Model(WORLD, _Mesh(("pp", "fsdp", "tp"), dist.new_group(list(range(WORLD))))),
                             HEADS, 2 * HEADS)
    assert (layout.start, layout.stop) == (heads.start, heads.stop), layout
    for name, spec in METHODS.items():
        out[name] = {
            "single": _run(spec, slice(0, HEADS)),
            "tp": _run(spec, heads, shard=lambda c: kd.shard(c, layout.head_slice, HEADS, layout.group)),
            "alone": _run(spec, heads),
        }
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, join=True)
        out = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def _rows_equal(a, b):
    return np.array_equal(a["positions"], b["positions"]) and np.array_equal(a["keys"], b["keys"])


@pytest.mark.parametrize("name", list(METHODS))
def test_ranks_decide_what_one_process_decides(ranks, name):
    per_rank = HEADS // WORLD
    for r, out in enumerate(ranks):
        single, tp = out[name]["single"], out[name]["tp"]
        for layer in range(LAYERS):
            s, t = single["layers"][layer], tp["layers"][layer]
            assert t["budget"] == s["budget"], f"{name} rank {r} layer {layer}: budget {t['budget']} != 1-process {s['budget']}"
            assert t["concentration"] == s["concentration"], f"{name} rank {r} layer {layer}: concentration differs"
            heads = slice(r * per_rank, (r + 1) * per_rank)
            want = {"positions": s["positions"][:, heads], "keys": s["keys"][:, heads]}
            assert _rows_equal(t, want), f"{name} rank {r} layer {layer}: kept rows differ from the 1-process run's heads"
    for layer in range(LAYERS):
        budgets = [out[name]["tp"]["layers"][layer]["budget"] for out in ranks]
        assert len(set(budgets)) == 1, f"{name} layer {layer}: ranks disagree on the budget {budgets}"
        if name in PER_LAYER_KEPT:
            ref = ranks[0][name]["tp"]["layers"][layer]["positions"][:, 0]
            kept = [out[name]["tp"]["layers"][layer]["positions"] for out in ranks]
            assert all(np.array_equal(k[:, h], ref) for k in kept for h in range(k.shape[1])), \
                f"{name} layer {layer}: ranks keep different positions"
    sizes = [out[name]["tp"]["bytes"] for out in ranks]
    assert max(sizes) <= 1.01 * min(sizes), f"{name}: per-rank resident bytes {sizes} differ by more than 1 %"


@pytest.mark.parametrize("name", sorted(MUST_DIFFER_ALONE))
def test_without_agreement_ranks_diverge(ranks, name):
    # The check above can fail: ranks that decide from their own heads alone leave the 1-process run.
    per_rank = HEADS // WORLD
    differs = False
    for r, out in enumerate(ranks):
        single, alone = out[name]["single"], out[name]["alone"]
        heads = slice(r * per_rank, (r + 1) * per_rank)
        for layer in range(LAYERS):
            s, a = single["layers"][layer], alone["layers"][layer]
            want = {"positions": s["positions"][:, heads], "keys": s["keys"][:, heads]}
            differs |= a["budget"] != s["budget"] or not _rows_equal(a, want)
    assert differs, f"{name}: ranks without the agreement match the 1-process run: the test data cannot tell"


def test_bad_head_slices_are_named(ranks):
    for out in ranks:
        assert "must tile [0, 4)" in (out["errors"]["overlap"] or ""), out["errors"]["overlap"]
        assert "not at kv_heads = 4" in (out["errors"]["short"] or ""), out["errors"]["short"]
        assert "rank 1: layer 0 already holds tokens" in (out["errors"]["used"] or ""), out["errors"]["used"]


def test_a_tensor_parallel_models_layout_is_read_and_checked(ranks):
    for rank, out in enumerate(ranks):
        got = out["layouts"]
        assert got["one_device"] == got["tp_1"] == "None"
        assert got["flat_mesh"] == f"ModelLayout(rank {rank} of 2: KV heads [{2 * rank}, {2 * rank + 2}) of 4, " \
                                   f"query heads [{4 * rank}, {4 * rank + 4}) of 8)"
        assert got["no_mesh"].startswith(f"ModelLayout(rank {rank} of 2: KV heads [{4 * rank}, {4 * rank + 4}) of 8")
        assert "3 KV heads do not split over 2 tensor-parallel ranks" in got["odd_kv_heads"]
        assert "3 query heads do not split over 2" in got["odd_heads"]
        assert "split over 4 ranks (model._tp_size) but its tensor-parallel process group has 2" in got["size_mismatch"]
        assert "dimensions ('dp', 'fsdp') and none is named \"tp\"" in got["no_tp_dim"]


def test_check_slices_without_a_group():
    from kvslim.distributed import check_slices
    check_slices([(0, 2), (2, 4)], 4)
    with pytest.raises(kvslim.InputError, match="rank 1's head slice \\[1, 4\\)"):
        check_slices([(0, 2), (1, 4)], 4)
    with pytest.raises(kvslim.InputError, match="end at head 4, not at kv_heads = 6"):
        check_slices([(0, 2), (2, 4)], 6)


class _Gather(kvslim._kvslim.RankGather):
    """A gather of one rank that returns what it is told to (no process group)."""

    def __init__(self, reply):
        super().__init__()
        self.reply, self.calls = reply, 0

    def all_gather(self, local):
        self.calls += 1
        return self.reply(np.asarray(local))


def _squeeze_prompt(gather):
    caches = kvslim.CacheSet(kvslim.Config(method="squeeze", squeeze_budget=40, evict_cross_layer=0), num_layers=2,
                             kv_heads=2, head_dim=DIM)
    caches.set_rank_gather(gather)
    rng = np.random.default_rng(1)
    positions = np.arange(PROMPT, dtype=np.int64)
    for layer in range(2):
        keys = rng.standard_normal((1, 2, PROMPT, DIM)).astype(np.float32)
        view = caches[layer].update(keys, keys, positions)
        queries = caches[layer].needs()["attention_queries"] or PROMPT
        caches[layer].observe_attention(_probs(view, keys[:, :, -queries:], positions[-queries:]), positions[-queries:])
    return caches


def test_a_gather_of_one_rank_is_the_process_alone():
    gather = _Gather(lambda local: [local])
    with_gather, alone = _squeeze_prompt(gather), _squeeze_prompt(None)
    assert gather.calls == 1  # one collective for the schedule
    for layer in range(2):
        assert with_gather[layer].stats()["figures"] == alone[layer].stats()["figures"]


def test_a_gather_that_returns_no_floats_is_named():
    with pytest.raises(kvslim.InputError, match="rank 0's entry is not a 1-d sequence of floats"):
        _squeeze_prompt(_Gather(lambda local: [np.zeros((2, 2))]))
