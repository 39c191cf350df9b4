"""Issue 26 from Python: stale copy=False views raise instead of crashing, positions above 2^63 - 1
are refused instead of wrapping, a CacheSet of a negative layer count is refused, float config
fields read back exactly, and non-finite observations are refused at the call."""
import numpy as np
import pytest

import kvslim


def block(tokens=4, seed=0):
    return np.random.default_rng(seed).standard_normal((1, 2, tokens, 8)).astype(np.float32)


@pytest.mark.parametrize("method", kvslim.methods())
def test_a_copy_false_view_read_after_reset_raises(method):
    cache = kvslim.Cache(kvslim.Config(method=method))
    k = block(300)
    view = cache.update(k, k, copy=False)
    assert view.keys.shape[2] > 0
    cache.reset()
    with pytest.raises(kvslim.StaleViewError, match="copy=False"):
        view.keys.sum()
    for what in ("values", "positions"):
        with pytest.raises(kvslim.StaleViewError):
            getattr(view, what)
    # After an update too, and after a reset of the whole set.
    view = cache.update(k, k, copy=False)
    cache.update(k, k)
    with pytest.raises(kvslim.StaleViewError):
        view.keys
    cs = kvslim.CacheSet(kvslim.Config(method=method), num_layers=2, kv_heads=2, head_dim=8)
    view = cs[1].update(k, k, copy=False)
    cs.reset()
    with pytest.raises(kvslim.StaleViewError):
        view.values
    # The default copy is the caller's own and survives anything.
    owned = cache.update(k, k)
    cache.reset()
    assert np.isfinite(owned.keys.astype(np.float32)).all() and owned.keys.flags.writeable
    k2, v2, p2 = owned  # a view still unpacks as (keys, values, positions)
    assert k2.shape == owned.keys.shape


def test_positions_above_int64_are_refused_not_wrapped():
    cache = kvslim.Cache()
    k = block(2)
    with pytest.raises(kvslim.InputError, match="9223372036854775807"):
        cache.update(k, k, positions=np.array([2**63 + 1, 2**63 + 2], dtype=np.uint64))
    with pytest.raises((kvslim.InputError, OverflowError)):
        cache.update(k, k, positions=[2**63 + 1, 2**63 + 2])
    assert cache.stats().tokens_seen == 0
    cache.update(k, k, positions=np.array([5, 6], dtype=np.uint64))  # in range: taken
    assert cache.view().positions.max() == 6


@pytest.mark.parametrize("layers", [-3, 0, True, 2.0, "2"])
def test_cacheset_refuses_a_layer_count_that_is_not_positive(layers):
    with pytest.raises(kvslim.InputError, match="num_layers"):
        kvslim.CacheSet(kvslim.Config(), num_layers=layers, kv_heads=2, head_dim=8)
    with pytest.raises(kvslim.InputError, match="at least one layer"):
        kvslim.CacheSet(kvslim.Config(), layers=[])


def test_float_fields_read_back_exactly():
    cfg = kvslim.Config(method="h2o", evict_decay=0.9999999, zipcache_hi_fraction=0.123456789012345)
    assert cfg.evict_decay == 0.9999999
    assert cfg.zipcache_hi_fraction == 0.123456789012345
    assert cfg.copy().fields()["evict_decay"] == 0.9999999


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_observations_are_refused_at_the_call(bad):
    cfg = kvslim.Config(method="h2o", evict_scoring="attention")
    cache = kvslim.Cache(cfg)
    k = block(40)
    t = cache.update(k, k).tokens
    probs = np.full((1, 2, 1, t), 1.0 / t, np.float32)
    probs[0, 1, 0, 3] = bad
    with pytest.raises(kvslim.InputError, match="NaN or infinite"):
        cache.observe_attention(probs, np.array([39]))
    probs[0, 1, 0, 3] = 0.0
    cache.observe_attention(probs, np.array([39]))
    cs = kvslim.CacheSet(kvslim.Config(method="squeeze", squeeze_signal="hidden_cosine"), num_layers=2, kv_heads=2, head_dim=8)
    cs[0].update(k, k)
    before = np.ones((1, 40, 16), np.float32)
    after = before.copy()
    after[0, 7, 2] = bad
    with pytest.raises(kvslim.InputError, match="NaN or infinite"):
        cs[0].observe_hidden(before, after)
