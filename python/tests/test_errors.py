"""Bad input from Python raises a Python exception that names what is wrong; nothing crashes."""
import numpy as np
import pytest

import kvslim


def block(shape=(1, 2, 4, 8), dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("fields, named", [
    ({"method": "nope"}, "method"),
    ({"method": "h2o", "h2o_budget": 0}, "h2o_budget"),
    ({"method": "squeeze", "squeeze_strength": 1.5}, "squeeze_strength"),
    ({"method": "zipcache", "zipcache_staging": 33}, "zipcache_staging"),
    ({"kivi_bits": 3.5}, "kivi_bits"),              # a float for an int field
    ({"squeeze_budget": "many"}, "squeeze_budget"),  # text that is no number
    ({"zipcache_quantize_values": 1}, "zipcache_quantize_values"),  # an int for a bool
    ({"h2o_budgt": 4}, "h2o_budgt"),                 # no such field
])
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(kvslim.ConfigError, match=named):
        kvslim.Config(**fields)


def test_config_error_is_a_value_error_and_caught_at_build_time():
    assert issubclass(kvslim.ConfigError, ValueError) and issubclass(kvslim.InputError, ValueError)
    cfg = kvslim.Config(method="h2o")
    cfg.h2o_budget = -3  # assignment checks the type; the range is checked when caches are built
    with pytest.raises(kvslim.ConfigError, match="h2o_budget"):
        kvslim.CacheSet(cfg, num_layers=2, kv_heads=1, head_dim=8)
    with pytest.raises(kvslim.ConfigError, match="h2o_budget"):
        kvslim.Cache(cfg)
    with pytest.raises(AttributeError):
        cfg.not_a_field


def test_config_round_trip_and_types():
    cfg = kvslim.Config(method="squeeze", squeeze_budget=64, squeeze_strength=0.5, squeeze_resolved_budget=40,
                        zipcache_quantize_values=False)
    assert (cfg.method, cfg.squeeze_budget, cfg.squeeze_strength) == ("squeeze", 64, 0.5)
    assert cfg.squeeze_resolved_budget == 40 and cfg.zipcache_quantize_values is False
    cfg.squeeze_resolved_budget = None
    assert cfg.squeeze_resolved_budget is None
    assert isinstance(kvslim.Config().squeeze_strength, float)
    assert cfg.copy() == cfg and cfg.copy() is not cfg
    assert list(cfg.fields())[:3] == ["method", "head_dim", "seed"]


@pytest.mark.parametrize("keys, values, named", [
    (block((2, 4, 8)), block((2, 4, 8)), "keys"),                    # 3 dimensions
    (block().astype(np.float64), block().astype(np.float64), "keys"),  # float64
    (block().astype(np.int32), block().astype(np.int32), "keys"),
    ([[1.0]], [[1.0]], "keys"),                                       # not an array
    (block(), block(dtype=np.float16), "values"),                     # mixed dtypes
    (block(), block((1, 2, 5, 8)), "shape"),                          # shapes differ
])
def test_update_errors_name_the_input(keys, values, named):
    cache = kvslim.Cache(kvslim.Config())
    with pytest.raises(kvslim.InputError, match=named):
        cache.update(keys, values)


def test_nan_keys_and_backward_positions_and_changed_heads():
    cache = kvslim.Cache(kvslim.Config())
    bad = block()
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(kvslim.InputError):
        cache.update(bad, block())
    cache.update(block(), block(), positions=[0, 1, 2, 3])
    with pytest.raises(kvslim.InputError, match="position"):
        cache.update(block((1, 2, 1, 8)), block((1, 2, 1, 8)), positions=[2])
    with pytest.raises(kvslim.InputError):
        cache.update(block((1, 3, 1, 8)), block((1, 3, 1, 8)))  # heads changed
    with pytest.raises(kvslim.InputError, match="positions"):
        cache.update(block((1, 2, 1, 8)), block((1, 2, 1, 8)), positions=[1.5])
    assert cache.stats().tokens_seen == 4  # the failed calls absorbed nothing


def test_torch_errors():
    torch = pytest.importorskip("torch")
    cache = kvslim.Cache(kvslim.Config())
    with pytest.raises(kvslim.InputError, match="keys.*int64"):
        cache.update(torch.zeros(1, 1, 2, 8, dtype=torch.int64), torch.zeros(1, 1, 2, 8, dtype=torch.int64))
    with pytest.raises(kvslim.InputError, match="values"):
        cache.update(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8, dtype=torch.float16))


def test_observation_errors():
    cache = kvslim.Cache(kvslim.Config(method="h2o", evict_scoring="attention", h2o_budget=8))
    view = cache.update(block(), block())
    with pytest.raises(kvslim.InputError, match="probs"):
        cache.observe_attention(np.ones((1, 2, 4), np.float32), [0, 1, 2, 3])
    with pytest.raises(kvslim.InputError, match="probs"):
        cache.observe_attention(np.ones((1, 2, 4, view.tokens + 1), np.float32), [0, 1, 2, 3])
    with pytest.raises(kvslim.InputError, match="query_positions"):
        cache.observe_attention(np.ones((1, 2, 4, view.tokens), np.float32), [0, 1])
    with pytest.raises(kvslim.InputError, match="after"):
        cache.observe_hidden(np.ones((1, 4, 16), np.float32), np.ones((1, 4, 8), np.float32))


def test_cache_set_errors():
    cfg = kvslim.Config()
    with pytest.raises(kvslim.InputError, match=r"layers\[1\]: kv_heads"):
        kvslim.CacheSet(cfg, layers=[(True, 2, 8), (True, 0, 8)])
    with pytest.raises(TypeError):
        kvslim.CacheSet(cfg, num_layers=2)
    cs = kvslim.CacheSet(cfg, layers=[(True, 2, 8), (False, 0, 0), (True, 2, 8)])
    assert len(cs) == 3 and cs[1] is None and cs[2].layer_id == 2
    with pytest.raises(IndexError):
        cs[3]


def test_attend_kernels_names_the_packed_code_path():
    name = kvslim.attend_kernels()
    assert name.startswith("int8 dot products (AVX-512 VNNI + VBMI)") or name.startswith("fp32 kernels ("), name
