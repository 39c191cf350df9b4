"""The attend contract from Python (issue 11's append + attend over the cache's own storage):
skipped by builds without it (kvslim.has_attend()). The caches' own attention must agree with the
torch attention over the materialised view for every method, feed the same signals back, and
reject bad queries."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvslim

if not kvslim.has_attend():
    pytest.skip("this kvslim build has the update_and_fetch contract only", allow_module_level=True)

from kvslim._attention import LayerState  # noqa: E402
from test_binding_vs_cpp import CONFIGS, config_of  # noqa: E402

B, HQ, HKV, D = 1, 4, 2, 16


def qkv(s, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, s, D, generator=g), torch.randn(B, HKV, s, D, generator=g),
            torch.randn(B, HKV, s, D, generator=g))


def causal_attention(q, k, v):
    """[B, H_q, S, D] queries over their own step's keys/values, causal, fp32: [B, S, H_q, D]."""
    g = HQ // HKV
    w = torch.matmul(q, k.repeat_interleave(g, 1).transpose(2, 3)) * D ** -0.5
    s = q.shape[2]
    w = w.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(w, dim=-1), v.repeat_interleave(g, 1)).transpose(1, 2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_attention_matches_torch_over_the_view(name):
    fields = config_of(name)
    fields.update({k: 12 for k in ("h2o_budget", "squeeze_budget", "pyramidkv_budget", "streaming_budget")
                   if k.split("_")[0] == fields["method"]})
    if fields["method"] in ("h2o", "squeeze", "pyramidkv"):
        # Max-pooling gives whole neighbourhoods the same score (their maximum), so which rows stay
        # turns on the last bit of two nearly equal maxima, where torch's softmax and the kernel's
        # may round apart: the same-rows check below runs unpooled.
        fields["evict_pool_kernel"] = 1
    states = {mode: LayerState(kvslim.Cache(kvslim.Config(**fields)), mode) for mode in ("kvslim", "torch")}
    for step, s in enumerate([20, 1, 1, 9, 1, 1, 40, 1]):
        q, k, v = qkv(s, step)
        outs = {mode: st.attend(q, *st.update(k, v)) [0] for mode, st in states.items()}
        if step == 0:
            # A prompt into an empty cache: "kvslim" mode attends over the step's own states, before
            # the cache compresses (or, streaming, evicts) them -- plain causal attention.
            torch.testing.assert_close(outs["kvslim"], causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
            continue
        # attend: fp32 over the stored rows; torch: fp32 over the same rows as fp16 -- equal to rounding.
        torch.testing.assert_close(outs["kvslim"], outs["torch"], rtol=2e-3, atol=2e-3)
    a, b = (states[m].cache.view() for m in ("kvslim", "torch"))
    np.testing.assert_array_equal(a.positions, b.positions)  # same signals fed back: same rows kept


def test_append_attend_rows_and_errors():
    # The documented core evicts inside append (key proxy); the query-aware default waits for attention.
    cache = kvslim.Cache(kvslim.Config(method="h2o", h2o_budget=8, evict_profile="original"))
    _, k, v = qkv(12, 0)
    cache.append(k, v)
    assert cache.rows() == 8
    q = np.zeros((1, 1, HQ, D), np.float32)
    out, probs = cache.attend(q, [12], probs=True)
    assert out.shape == (1, 1, HQ, D) and probs.shape == (1, HKV, 1, 8)
    np.testing.assert_allclose(probs.sum(-1), HQ // HKV, rtol=1e-5)
    with pytest.raises(kvslim.InputError, match="queries"):
        cache.attend(np.zeros((1, HQ, D), np.float32), [12])
    with pytest.raises(kvslim.InputError):
        cache.attend(np.zeros((1, 1, 3, D), np.float32), [12])  # 3 heads: not a multiple of 2
    with pytest.raises(kvslim.InputError):
        cache.attend(q, [12, 13])  # two positions for one query
    with pytest.raises(kvslim.InputError, match="keys"):
        cache.append(np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 3), np.float32))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attend_and_observe_equals_attend_then_observe(name):
    """Cache.attend_and_observe (the attention step of kvslim.hf) is attend with probabilities, then
    observe_attention of them: the same outputs, the same rows kept."""
    fields = config_of(name)
    fields.update({k: 12 for k in ("h2o_budget", "squeeze_budget", "pyramidkv_budget", "streaming_budget")
                   if k.split("_")[0] == fields["method"]})
    two, one = (kvslim.Cache(kvslim.Config(**fields)) for _ in range(2))
    observes = two.needs()["attention"]
    pos = 0
    for step, s in enumerate([20, 1, 1, 9, 1, 1, 40, 1, 1]):
        q, k, v = qkv(s, 100 + step)
        positions = np.arange(pos, pos + s, dtype=np.int64)
        pos += s
        queries = q.transpose(1, 2).contiguous().numpy()
        for c in (two, one):
            c.append(k.numpy(), v.numpy(), positions)
        out, probs = two.attend(queries, positions, probs=observes)
        if observes:
            two.observe_attention(probs, positions)
        np.testing.assert_array_equal(one.attend_and_observe(queries, positions), out, err_msg=f"step {step}")
        assert one.rows() == two.rows()
    np.testing.assert_array_equal(one.view().positions, two.view().positions)
    with pytest.raises(kvslim.InputError, match="queries"):
        one.attend_and_observe(np.zeros((1, HQ, D), np.float32), [pos])
