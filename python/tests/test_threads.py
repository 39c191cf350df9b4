"""Issue 26, item 5: a pure-Python program must not crash the interpreter. Two threads drive every
method of the binding, on one shared cache and on separate caches, for every cache method; each
call either succeeds or raises a kvslim error (a shared cache may see the other thread's tokens
between its calls), and the process survives. Run in a subprocess, so a crash is a failure with
its output, not the end of the test session."""
import os
import subprocess
import sys
import textwrap

import pytest

import kvslim

STRESS = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import kvslim

    method, shared = sys.argv[1], sys.argv[2] == "shared"
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    STEPS = int(sys.argv[3])
    errors, crashes = [], []

    def make():
        return kvslim.Cache(kvslim.Config(method=method))

    common = make()

    def drive(seed):
        cache = common if shared else make()
        rng = np.random.default_rng(seed)
        big = rng.standard_normal((1, 4, 256, 128)).astype(np.float32)  # large: numpy copies them without the GIL
        one = big[:, :, :1]
        try:
            for step in range(STEPS):
                try:
                    view = cache.update(big if step % 2 == 0 else one, big if step % 2 == 0 else one)
                    float(view.keys.astype(np.float32).sum())  # read the copy while the other thread writes
                    view.positions.max()
                    cache.view().values.sum()
                    cache.stats()
                    if cache.needs()["attention"]:
                        t = cache.view().tokens
                        probs = np.full((1, 4, 1, t), 1.0 / max(t, 1), np.float32)
                        cache.observe_attention(probs, np.array([10**6 + step], np.int64))
                    if kvslim.has_attend():
                        cache.append(one, one)
                        q = rng.standard_normal((1, 1, 8, 128)).astype(np.float32)
                        out, probs = cache.attend(q, np.array([10**7 + step]), probs=True)
                        assert np.isfinite(out).all()
                        cache.rows()
                    stale = cache.view(copy=False)
                    cache.update(one, one)
                    try:
                        stale.keys.sum()
                    except kvslim.StaleViewError:
                        pass
                    else:
                        crashes.append("a copy=False view read after update did not raise")
                    if step % 10 == 9:  # frees the store: a view still aliasing it would be read after free
                        cache.reset()
                except (kvslim.InputError, kvslim.ConfigError) as e:
                    errors.append(str(e))
        except Exception as e:  # anything else is a defect
            crashes.append(repr(e))

    threads = [threading.Thread(target=drive, args=(s,)) for s in (1, 2)]
    for t in threads: t.start()
    for t in threads: t.join()
    if crashes:
        print("\\n".join(crashes[:5])); sys.exit(1)
    if not shared and errors:
        print("\\n".join(errors[:5])); sys.exit(1)  # separate caches: nothing may fail
    print("ok", len(errors))
""")


@pytest.mark.parametrize("shared", ["shared", "separate"])
@pytest.mark.parametrize("method", kvslim.methods())
def test_two_threads_never_crash(method, shared):
    out = subprocess.run([sys.executable, "-c", STRESS, method, shared, "250"], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert out.returncode == 0, f"{method} {shared}: exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"


def test_a_set_driven_from_two_threads_layer_by_layer():
    # The library's rule: different layers of one set from different threads at once.
    import threading
    import numpy as np
    for method in kvslim.methods():
        cs = kvslim.CacheSet(kvslim.Config(method=method), num_layers=2, kv_heads=2, head_dim=16)
        k = np.random.default_rng(0).standard_normal((1, 2, 8, 16)).astype(np.float32)
        failures = []

        def drive(layer):
            try:
                for _ in range(100):
                    cs[layer].update(k, k).keys.sum()
                    cs[layer].stats()
            except Exception as e:
                failures.append(repr(e))

        threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not failures, (method, failures)


def test_the_binding_copies_the_view_inside_the_call():
    # The deterministic half of the rule above: the arrays the C++ call returns by default own
    # their memory (they were copied with the GIL held); only copy=False aliases the cache.
    import numpy as np
    cache = kvslim.Cache()
    k = np.ones((1, 2, 300, 16), np.float32)
    keys, values, positions = cache._core.update_and_fetch(k, k, None, "")
    assert all(a.flags.owndata and a.flags.writeable for a in (keys, values, positions))
    keys, values, positions = cache._core.view()
    assert all(a.flags.owndata for a in (keys, values, positions))
    aliased = cache._core.view(False)
    assert not any(a.flags.owndata for a in aliased)
