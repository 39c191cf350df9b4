"""The binding against the C++ library on the same inputs: every method, bit for bit.

kvslim_pyref (python/tests/pyref.cc) runs a CacheSet over blocks read from a file; the same blocks
go through kvslim.CacheSet here. Final views (positions, fp16 keys and values) and stats must match
exactly, including the attention-scored configurations (same synthetic attention both sides)."""
import subprocess

import numpy as np
import pytest

import kvslim

LAYERS, HEADS, DIM = 3, 2, 16
STEPS = [40] + [1] * 20 + [7]  # a prompt, decode steps, a second chunk

CONFIGS = {
    "full": {},
    "streaming": {"streaming_budget": 16},
    "h2o": {"h2o_budget": 16},
    "h2o_attention": {"method": "h2o", "h2o_budget": 16, "evict_scoring": "attention"},
    "squeeze": {"squeeze_budget": 16},
    "squeeze_attention": {"method": "squeeze", "squeeze_budget": 16, "evict_scoring": "attention_normalized"},
    "pyramidkv": {"pyramidkv_budget": 16},
    "zipcache": {"zipcache_staging": 32, "zipcache_group_size": 32},
    "zipcache_attention": {"method": "zipcache", "zipcache_staging": 32, "zipcache_group_size": 32, "zipcache_saliency": "attention_normalized"},
    "kivi": {"kivi_group_size": 32, "kivi_staging": 32},
}


def config_of(name):
    fields = dict(CONFIGS[name])
    fields.setdefault("method", name)
    return fields


def probs_rule(positions, queries, head, layer):
    # Same numbers as probs_rule() in pyref.cc (k/32, exact in fp32).
    q = np.arange(queries, dtype=np.int64)[:, None]
    return (((positions[None, :] * 7 + q * 3 + head * 5 + layer) % 17 + 1) / 32.0).astype(np.float32)


def make_steps(seed=7):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal((1, HEADS, s, DIM), dtype=np.float32),
              rng.standard_normal((1, HEADS, s, DIM), dtype=np.float32)) for _ in range(LAYERS)] for s in STEPS]


def run_cpp(pyref, tmp_path, fields, steps):
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        for step in steps:
            np.array([step[0][0].shape[2]], dtype=np.int64).tofile(f)
            for k, v in step:
                k.tofile(f)
                v.tofile(f)
        np.array([0], dtype=np.int64).tofile(f)
    args = [pyref, str(src), str(out), str(LAYERS), str(HEADS), str(DIM)]
    args += [f"{k}={kvslim._config._to_text(k, v)}" for k, v in fields.items()]
    subprocess.run(args, check=True)
    raw = out.read_bytes()
    layers, off = [], 0
    for _ in range(LAYERS):
        t = int(np.frombuffer(raw, np.uint64, 1, off)[0]); off += 8
        pos = np.frombuffer(raw, np.int64, HEADS * t, off).reshape(HEADS, t); off += 8 * HEADS * t
        k = np.frombuffer(raw, np.float16, HEADS * t * DIM, off).reshape(HEADS, t, DIM); off += 2 * HEADS * t * DIM
        v = np.frombuffer(raw, np.float16, HEADS * t * DIM, off).reshape(HEADS, t, DIM); off += 2 * HEADS * t * DIM
        resident, seen, kept = (int(x) for x in np.frombuffer(raw, np.uint64, 3, off)); off += 24
        layers.append(dict(positions=pos, keys=k, values=v, resident_bytes=resident, tokens_seen=seen, tokens_kept=kept))
    assert off == len(raw)
    return layers


def run_python(fields, steps, convert=lambda a: a):
    cs = kvslim.CacheSet(kvslim.Config(**fields), num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
    next_pos = 0
    for step in steps:
        s = step[0][0].shape[2]
        for layer, (k, v) in enumerate(step):
            cache = cs[layer]
            view = cache.update(convert(k), convert(v))
            if cache.needs()["attention"]:
                probs = np.stack([probs_rule(view.positions[0, h], s, h, layer) for h in range(HEADS)])[None]
                cache.observe_attention(probs, np.arange(next_pos, next_pos + s))
        next_pos += s
    return cs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_views_and_stats_as_cpp(pyref, tmp_path, name):
    fields = config_of(name)
    steps = make_steps()
    cpp = run_cpp(pyref, tmp_path, fields, steps)
    cs = run_python(fields, steps)
    for layer, ref in enumerate(cpp):
        view = cs[layer].view()
        st = cs[layer].stats()
        np.testing.assert_array_equal(view.positions[0], ref["positions"], err_msg=f"{name} layer {layer} positions")
        assert view.keys[0].tobytes() == ref["keys"].tobytes(), f"{name} layer {layer} keys"
        assert view.values[0].tobytes() == ref["values"].tobytes(), f"{name} layer {layer} values"
        assert (st.resident_bytes, st.tokens_seen, st.tokens_kept) == \
            (ref["resident_bytes"], ref["tokens_seen"], ref["tokens_kept"]), f"{name} layer {layer} stats"
    # Every compressing configuration really compressed something here (zipcache with attention
    # saliency keeps its score state and 2 staging blocks: at D=16 and 67 tokens that outweighs it).
    if name not in ("full", "zipcache_attention"):
        assert cs.resident_bytes() < cs.seen_fp16_bytes()


def test_methods_list_matches_library():
    assert kvslim.methods() == ["full", "streaming", "h2o", "squeeze", "pyramidkv", "zipcache", "kivi"]
    for m in kvslim.methods():
        assert kvslim.Cache(kvslim.Config(method=m)).method == m


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_tensors_give_the_numpy_results(dtype):
    torch = pytest.importorskip("torch")
    steps = make_steps(seed=3)
    tdtype = getattr(torch, dtype)
    # The reference: the same values rounded to the tensor dtype, passed as numpy fp32.
    rounded = [[(torch.from_numpy(k).to(tdtype).float().numpy(), torch.from_numpy(v).to(tdtype).float().numpy())
                for k, v in step] for step in steps]
    fields = config_of("squeeze")
    ref = run_python(fields, rounded)
    got = run_python(fields, steps, convert=lambda a: torch.from_numpy(a).to(tdtype))
    for layer in range(LAYERS):
        a, b = ref[layer].view(), got[layer].view()
        np.testing.assert_array_equal(a.positions, b.positions)
        assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()


def test_torch_strided_and_numpy_fp16_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 5, HEADS, DIM), dtype=np.float32)  # [B, S, H, D]: needs a transpose
    ref = kvslim.Cache(kvslim.Config())
    ref.update(np.ascontiguousarray(k.transpose(0, 2, 1, 3)).astype(np.float16),
               np.ascontiguousarray(k.transpose(0, 2, 1, 3)).astype(np.float16))
    got = kvslim.Cache(kvslim.Config())
    t = torch.from_numpy(k).transpose(1, 2)  # not contiguous: copied once, same values
    got.update(t.half(), t.half())
    assert ref.view().keys.tobytes() == got.view().keys.tobytes()


def test_view_without_copy_aliases_the_cache():
    cache = kvslim.Cache(kvslim.Config())
    k = np.ones((1, 1, 3, 8), np.float32)
    view = cache.update(k, k, copy=False)
    assert not view.keys.flags.writeable
    with pytest.raises(ValueError):
        view.keys[0, 0, 0, 0] = 2
    address = view.keys.__array_interface__["data"][0]
    assert cache.view(copy=False).keys.__array_interface__["data"][0] == address
    owned = cache.view()
    assert owned.keys.flags.writeable and owned.keys.__array_interface__["data"][0] != address


def test_inputs_are_read_in_place():
    # The block the C++ cache reads points at the caller's own memory when the layout allows.
    from kvslim import _kvslim
    from kvslim._arrays import as_block
    a = np.zeros((1, 2, 3, 8), np.float32)
    assert _kvslim._block_address(*as_block(a, "keys")) == a.ctypes.data
    h = a.astype(np.float16)
    assert _kvslim._block_address(*as_block(h, "keys")) == h.ctypes.data
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.zeros(1, 2, 3, 8, dtype=dtype)
        assert _kvslim._block_address(*as_block(t, "keys")) == t.data_ptr(), dtype
    strided = torch.zeros(1, 3, 2, 8).transpose(1, 2)  # needs one contiguous copy
    assert _kvslim._block_address(*as_block(strided, "keys")) != strided.data_ptr()
