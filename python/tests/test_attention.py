"""kvslim's torch attention over a cache view (the part of kvslim.hf that needs no transformers):
method full reproduces plain causal attention, the causal mask follows absolute positions after
evictions, and attention probabilities reach the caches that score with them."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvslim
from kvslim._attention import LayerState, repeat_kv

B, HQ, HKV, D = 1, 4, 2, 16
# "torch" (attention over the fp16 view here) always; "kvslim" (the cache's own attention) where
# the library has the attend contract.
MODES = ["torch"] + (["kvslim"] if kvslim.has_attend() else [])


def qkv(s, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, s, D, generator=g), torch.randn(B, HKV, s, D, generator=g),
            torch.randn(B, HKV, s, D, generator=g))


def reference(q, k, v, q_pos, k_pos):
    """Plain causal attention over every key (fp32), query at q_pos sees keys at positions <= it."""
    w = torch.matmul(q, repeat_kv(k, HQ // HKV).transpose(2, 3)) * D ** -0.5
    w = w.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    return torch.matmul(torch.softmax(w, dim=-1), repeat_kv(v, HQ // HKV)).transpose(1, 2)


@pytest.mark.parametrize("mode", MODES)
def test_full_method_is_plain_causal_attention(mode):
    state = LayerState(kvslim.Cache(kvslim.Config(method="full")), mode)
    keys, values = [], []
    for step, s in enumerate([9, 1, 1, 5, 1]):
        q, k, v = qkv(s, step)
        kv_k, kv_v = state.update(k, v)
        out, _ = state.attend(q, kv_k, kv_v)
        # "kvslim" mode attends a prompt into an empty cache over the step's own (fp32) states;
        # everything else reads what the cache keeps: fp16.
        exact = mode == "kvslim" and step == 0
        keys.append(k if exact else k.half().float())
        values.append(v if exact else v.half().float())
        all_k, all_v = torch.cat(keys, 2), torch.cat(values, 2)
        pos = torch.arange(all_k.shape[2])
        ref = reference(q, all_k, all_v, pos[-s:], pos)
        keys[-1], values[-1] = k.half().float(), v.half().float()  # what the cache keeps for later steps
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert state.seen == 17


def test_mask_follows_positions_after_eviction():
    # A prompt longer than the budget: the view is evicted during prefill and its rows are out of
    # order; every query must still see exactly the kept rows at positions <= its own.
    cache = kvslim.Cache(kvslim.Config(method="h2o", h2o_budget=6, h2o_n_sink=2, evict_profile="original"))
    state = LayerState(cache, "torch")
    q, k, v = qkv(12, 1)
    vk, vv = state.update(k, v, torch.arange(100, 112))
    assert vk.shape[2] == 6
    out, _ = state.attend(q, vk, vv)
    pos = state.view_positions  # [B, H_kv, 6]
    for h in range(HQ):
        kh = h // (HQ // HKV)
        for i in range(12):
            seen = pos[0, kh] <= 100 + i
            if not bool(seen.any()):
                continue
            w = torch.softmax((vk[0, kh][seen] @ q[0, h, i]) * D ** -0.5, dim=0)
            torch.testing.assert_close(out[0, i, h], w @ vv[0, kh][seen], rtol=1e-5, atol=1e-6)


class Spy(kvslim.Cache):
    """Records what the attention hands to the cache."""

    def __init__(self, config):
        super().__init__(config)
        self.observed = []

    def observe_attention(self, probs, query_positions):
        self.observed.append((torch.as_tensor(np.array(probs)), torch.as_tensor(np.array(query_positions))))
        super().observe_attention(probs, query_positions)

    def attend_and_observe(self, queries, query_positions, scale=None):
        # The two calls it equals (test_attend.py), so that the spy sees the probabilities.
        out, probs = self.attend(queries, query_positions, scale, probs=self.needs()["attention"])
        if probs is not None:
            self.observe_attention(probs, query_positions)
        return out


@pytest.mark.parametrize("fields", [
    {"method": "h2o", "h2o_budget": 8, "evict_scoring": "attention"},
    {"method": "squeeze", "squeeze_budget": 8, "evict_scoring": "attention_normalized"},
    {"method": "zipcache", "zipcache_saliency": "attention_normalized", "zipcache_staging": 32, "zipcache_group_size": 32},
])
@pytest.mark.parametrize("mode", MODES)
def test_attention_probabilities_reach_the_cache(fields, mode):
    spy = Spy(kvslim.Config(**fields))
    state = LayerState(spy, mode)
    assert state.wants_attention
    steps = [10, 1, 1, 1, 4]
    for step, s in enumerate(steps):
        q, k, v = qkv(s, 10 + step)
        out, _ = state.attend(q, *state.update(k, v))
    assert len(spy.observed) == len(steps) == state.attention_reports
    probs, qpos = spy.observed[-1]
    assert probs.shape[:3] == (B, HKV, 4)  # [B, H_kv, queries, rows the step attended over]
    # Summed over the 2 query heads of each group: every query row sums to 2.
    torch.testing.assert_close(probs.sum(-1), torch.full((B, HKV, 4), 2.0))
    assert qpos.tolist() == [13, 14, 15, 16]
    # The same observations fed by hand give the same cache state: they are what the cache used.
    replay = kvslim.Cache(kvslim.Config(**fields))
    for step, (s, (p, qp)) in enumerate(zip(steps, spy.observed)):
        _, k, v = qkv(s, 10 + step)
        replay.update(k, v)
        replay.observe_attention(p, qp)
    np.testing.assert_array_equal(replay.view().positions, spy.view().positions)
    assert replay.view().keys.tobytes() == spy.view().keys.tobytes()


def test_attention_scoring_changes_what_is_kept():
    # Guard for the test above: observations matter (key-proxy scoring keeps a different set).
    kept = {}
    for scoring in ("key_proxy", "attention"):
        state = LayerState(kvslim.Cache(kvslim.Config(method="h2o", h2o_budget=8, evict_scoring=scoring)))
        for step, s in enumerate([10, 1, 1, 1, 4]):
            q, k, v = qkv(s, 10 + step)
            state.attend(q, *state.update(k, v))
        kept[scoring] = sorted(state.cache.view().positions[0, 0].tolist())
    assert kept["key_proxy"] != kept["attention"]


def test_attend_rejects_keys_that_are_not_the_view():
    state = LayerState(kvslim.Cache(kvslim.Config()), "torch")
    q, k, v = qkv(3, 0)
    with pytest.raises(RuntimeError, match="view"):
        state.attend(q, k, v)


def test_attention_mode_is_checked():
    with pytest.raises(ValueError, match="attention"):
        LayerState(kvslim.Cache(kvslim.Config()), "flash")
    if not kvslim.has_attend():
        with pytest.raises(ValueError, match="attend contract"):
            LayerState(kvslim.Cache(kvslim.Config()), "kvslim")
