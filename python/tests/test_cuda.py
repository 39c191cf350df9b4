"""Device caches from Python: torch CUDA tensors in, zero-copy, on torch's current stream. The GPU
tests run where a GPU and a CUDA build exist (the GPU machine); everywhere else the error for a CUDA
cache is checked."""
import numpy as np
import pytest

import kvslim

torch = pytest.importorskip("torch")
HAVE_GPU = kvslim.cuda_device_count() > 0 and torch.cuda.is_available()


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_cuda_cache_without_gpu_is_a_config_error():
    with pytest.raises(kvslim.ConfigError, match="cuda"):
        kvslim.Cache(kvslim.Config(method="kivi", device="cuda"))


def test_device_field_is_validated():
    with pytest.raises(kvslim.ConfigError, match="device"):
        kvslim.Config(method="full", device="gpu0").validate()


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / CUDA build")
@pytest.mark.parametrize("method,bits,dtype", [("full", 2, torch.bfloat16), ("kivi", 2, torch.float16),
                                               ("kivi", 4, torch.bfloat16)])
def test_device_cache_matches_the_cpu_cache(method, bits, dtype):
    g = torch.Generator().manual_seed(0)
    B, H, G, D = 2, 4, 4, 128
    cpu = kvslim.Cache(kvslim.Config(method=method, kivi_bits=bits))
    gpu = kvslim.Cache(kvslim.Config(method=method, kivi_bits=bits, device="cuda"))
    pos = 0
    for S in (300, 1, 1, 17, 1):
        k = torch.randn(B, H, S, D, generator=g).to(dtype)
        v = torch.randn(B, H, S, D, generator=g).to(dtype)
        positions = np.arange(pos, pos + S)
        pos += S
        cpu.append(k, v, positions)
        gpu.append(k.cuda(), v.cuda(), positions)
        q = torch.randn(B, 1, H * G, D, generator=g)
        out_c, probs_c = cpu.attend(q, [pos - 1], probs=True)
        out_g, probs_g = gpu.attend(q.cuda(), [pos - 1], probs=True)
        assert out_g.is_cuda and probs_g.is_cuda
        np.testing.assert_allclose(out_g.cpu().numpy(), out_c, rtol=4e-3, atol=4e-3)
        np.testing.assert_allclose(probs_g.cpu().numpy(), probs_c, atol=2e-3)
    assert gpu.rows() == cpu.rows() == pos


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / CUDA build")
def test_device_cache_follows_torch_current_stream():
    s = torch.cuda.Stream()
    gpu = kvslim.Cache(kvslim.Config(method="kivi", device="cuda"))
    with torch.cuda.stream(s):
        k = torch.randn(1, 2, 200, 64, device="cuda")
        gpu.append(k, k * 0.5)  # the kernel reads k on stream s, after randn
        out, _ = gpu.attend(torch.randn(1, 1, 4, 64, device="cuda"), [199])
    s.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / CUDA build")
@pytest.mark.parametrize("storage", ["fp16", "kivi"])
def test_device_attend_and_observe_equals_attend_then_observe(storage):
    """Cache.attend_and_observe on a device eviction cache (kvslim.hf's layer step): the outputs,
    rows and kept positions of attend(probs=True) + observe_attention, step after step."""
    g = torch.Generator().manual_seed(1)
    B, H, G, D = 2, 2, 4, 128
    fields = dict(method="h2o", h2o_budget=96, storage=storage, device="cuda")
    two, one = kvslim.Cache(kvslim.Config(**fields)), kvslim.Cache(kvslim.Config(**fields))
    pos = 0
    for step, S in enumerate([300] + [1] * 60 + [17] + [1] * 10):
        k = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16).cuda()
        v = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16).cuda()
        q = torch.randn(B, S, H * G, D, generator=g).cuda()
        positions = np.arange(pos, pos + S)
        pos += S
        for c in (two, one):
            c.append(k, v, positions)
        out, probs = two.attend(q, positions, probs=True)
        two.observe_attention(probs, positions)
        out1 = one.attend_and_observe(q, positions)
        assert torch.equal(out1, out), f"step {step}"
        assert one.rows() == two.rows()
    np.testing.assert_array_equal(one.view().positions, two.view().positions)
