"""kvslim.hf with caches in GPU memory (Config(device="cuda")): a transformers model generates with
its keys and values appended in place and decode attention in kvslim's CUDA kernels. Checked
against transformers' own DynamicCache (SDPA) on the same model: the prompt's logits (SDPA in both)
and every decode step's logits, for the dense store and for 8-bit codes; and that a 2-bit cache
holds its bytes on the device. Runs where a GPU, a CUDA build and transformers exist."""
import pytest

import kvslim

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
HAVE_GPU = kvslim.cuda_device_count() > 0 and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / CUDA build")


def small_llama(dtype):
    # head_dim 64 (the device kernels take 64 and 128), 4 query heads over 2 KV heads.
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()
    model.config._attn_implementation = "sdpa"
    return model


def step_logits(model, ids, cache, steps):
    """Logits [steps + 1, vocab] of the prompt's last position and of `steps` greedy decode steps
    fed the same tokens (`ids[0, -steps:]` continued from the prompt ids[:, :-steps])."""
    prompt, follow = ids[:, :-steps], ids[:, -steps:]
    out = []
    with torch.no_grad():
        r = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1].float())
        for i in range(steps):
            r = model(input_ids=follow[:, i:i + 1], past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1].float())
    return torch.stack(out)


@pytest.mark.parametrize("method,bits,tol", [("full", 2, 2e-3), ("kivi", 8, 3e-2)])
def test_device_cache_decodes_like_dynamic_cache(method, bits, tol):
    import kvslim.hf
    from transformers import DynamicCache
    model = small_llama(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(3, 512, (1, 300), device="cuda", generator=g)  # 292-token prompt, 8 decode steps
    ref = step_logits(model, ids, DynamicCache(config=model.config), 8)
    kvslim.hf.prepare(model)
    try:
        cache = kvslim.hf.KVSlimCache(model, kvslim.Config(method=method, kivi_bits=bits, device="cuda"))
        got = step_logits(model, ids, cache, 8)
    finally:
        kvslim.hf.restore(model)
    scale = ref.abs().max()
    # The prompt: SDPA over the step's own states in both (kvslim's cache was empty).
    torch.testing.assert_close(got[0], ref[0], atol=1e-5 * scale, rtol=0)
    # Decode: kvslim's kernels over fp16 rows (full) or 8-bit codes (kivi), fp32 accumulation.
    err = ((got[1:] - ref[1:]).abs().max() / scale).item()
    assert err < tol, f"{method}: decode logits differ from DynamicCache by {err:.2e} of their scale"
    assert cache.layers[0].state.on_device
    assert cache.get_seq_length() == 300


def test_generate_with_kivi2_on_device_keeps_its_bytes_there():
    import kvslim.hf
    model = small_llama(torch.bfloat16)
    ids = torch.randint(3, 512, (2, 2000), device="cuda")
    kvslim.hf.prepare(model)
    try:
        cache = kvslim.hf.KVSlimCache(model, kvslim.Config(method="kivi", kivi_bits=2, device="cuda"))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    finally:
        kvslim.hf.restore(model)
    assert out.shape == (2, 2040)
    stats = cache.stats()
    assert all(s["tokens_kept"] == 2039 for s in stats)  # the last token is generated, never appended
    # 2-bit codes + fp16 group parameters (1,920 rows) + the two fp16 windows of 128 rows: ~0.3 of
    # a bf16 cache's bytes at this length.
    assert 0 < cache.resident_bytes() < 0.4 * cache.seen_fp16_bytes()


def test_device_cache_refuses_torch_attention():
    import kvslim.hf
    model = small_llama(torch.float16)
    with pytest.raises(ValueError, match="kvslim"):
        kvslim.hf.KVSlimCache(model, kvslim.Config(method="full", device="cuda"), attention="torch")


def kept_positions(cache):
    """Per layer, the set of (batch, head, position) rows the layer keeps."""
    out = []
    for layer in cache.layers:
        p = layer.state.cache.view().positions  # [B, H_kv, T]
        out.append({(b, h, int(x)) for b in range(p.shape[0]) for h in range(p.shape[1]) for x in p[b, h]})
    return out


def cpu_and_gpu(config, seed, batch=1, prompt=300, steps=8):
    """The same fp32 model and prompt through a host cache and a device cache of `config`: (cpu
    cache, gpu cache, cpu logits, gpu logits) of the prompt and `steps` decode steps."""
    import kvslim.hf
    model = small_llama(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(3, 512, (batch, prompt), device="cuda", generator=g)
    kvslim.hf.prepare(model)
    try:
        cpu = kvslim.hf.KVSlimCache(model, kvslim.Config(**config), attention="kvslim")
        ref = step_logits(model, ids, cpu, steps)
        gpu = kvslim.hf.KVSlimCache(model, kvslim.Config(device="cuda", **config))
        got = step_logits(model, ids, gpu, steps)
    finally:
        kvslim.hf.restore(model)
    return cpu, gpu, ref, got


def assert_logits_close(ref, got, tol, what):
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"{what} on the device: logits differ from the CPU cache's by {err:.2e} of their scale"


def test_h2o_on_device_evicts_like_the_cpu_cache():
    # The device cache runs the CPU's eviction core over rows in GPU memory; the observations differ
    # only by the kernels' rounding (SDPA + kvslim's window probs against the CPU's kernels), so the
    # kept rows agree but for near-ties, and the logits follow.
    cpu, gpu, ref, got = cpu_and_gpu(dict(method="h2o", h2o_budget=128), seed=5)
    assert gpu.layers[0].state.on_device and not cpu.layers[0].state.on_device
    assert gpu.signal_reports()["attention"] == 3 * 9  # the prompt's window and every decode step, per layer
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert len(d) == 2 * 128
        assert len(c & d) >= 0.97 * len(c)
    assert_logits_close(ref, got, 2e-2, "h2o")
    # The device holds the budget's rows, not the prompt's: 3 layers x 2 heads x (128 + 1 + 15)
    # slots of K, V, position, score and exposure.
    stats = gpu.stats()
    assert all(s["tokens_kept"] == 128 for s in stats)
    assert sum(s["figures"]["device_bytes"] for s in stats) <= 3 * 2 * 144 * (64 * 2 * 2 + 8 + 4 + 4)


def test_h2o_over_kivi_codes_on_device_evicts_like_the_cpu_cache():
    # A policy over a compressed storage on the GPU (DevicePackedRows): h2o's rows held as kivi codes
    # (keys 4 bits, values 2, groups of 32), decided by the CPU's eviction core from the device's
    # probabilities. Rows agree with the CPU cache's but for near-ties; the logits follow.
    cfg = dict(method="h2o", h2o_budget=128, storage="kivi", kivi_bits=4, kivi_value_bits=2, kivi_group_size=32,
               kivi_staging=32)
    cpu, gpu, ref, got = cpu_and_gpu(cfg, seed=5)
    assert gpu.layers[0].state.on_device
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert len(d) == 2 * 128
        assert len(c & d) >= 0.97 * len(c)
    assert_logits_close(ref, got, 3e-2, "h2o over kivi")
    for s in gpu.stats():
        assert s["tokens_kept"] == 128
        assert (s["figures"]["hi_bits"], s["figures"]["value_bits"]) == (4, 2)
        # Codes, not slots: well under the fp16 slots' bound of test_h2o_on_device_evicts_like_the_cpu_cache
        # (its window of up to 32 fp16 rows a head included).
        assert s["figures"]["device_bytes"] < 0.6 * 2 * 144 * (64 * 2 * 2 + 8 + 4 + 4)


def test_squeeze_over_zipcache_codes_on_device_evicts_like_the_cpu_cache():
    # Both seeds in one cache on the GPU: squeeze's per-layer budgets over zipcache's sets (half of
    # each 32-row group's keys at 4 bits by key norm, the rest at 2, values at 4), chosen on the
    # device as the CPU cache chooses them (tests/cuda: the same rows and codes given the same
    # observations); through a model, rows agree but for near-ties and the logits follow.
    cfg = dict(method="squeeze", squeeze_budget=96, storage="zipcache", zipcache_hi_bits=4, zipcache_lo_bits=2,
               zipcache_value_bits=4, zipcache_hi_fraction=0.5, zipcache_group_size=32, zipcache_staging=32)
    cpu, gpu, ref, got = cpu_and_gpu(cfg, seed=7)
    assert gpu.layers[0].state.on_device
    budgets = lambda cache: [s["figures"]["layer_budget"] for s in cache.stats()]
    assert budgets(gpu) == budgets(cpu)
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert len(c & d) >= 0.97 * len(c)
    assert_logits_close(ref, got, 3e-2, "squeeze over zipcache")
    for s in gpu.stats():
        assert (s["figures"]["hi_bits"], s["figures"]["lo_bits"], s["figures"]["value_bits"]) == (4, 2, 4)


def test_squeeze_on_device_schedules_like_the_cpu_cache():
    # The seed method on the GPU: the same shared schedule as the host cache, its key signal
    # measured by a device kernel; per-layer budgets equal, rows as h2o's (rounding near-ties).
    cpu, gpu, ref, got = cpu_and_gpu(dict(method="squeeze", squeeze_budget=96), seed=7)
    budgets = lambda cache: [s["figures"]["layer_budget"] for s in cache.stats()]
    assert budgets(gpu) == budgets(cpu)
    for c, d in zip(cpu.stats(), gpu.stats()):
        assert abs(c["figures"]["concentration"] - d["figures"]["concentration"]) < 1e-6
        assert d["figures"]["rebudgeted"] == 1.0
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert len(c & d) >= 0.97 * len(c)
    assert_logits_close(ref, got, 2e-2, "squeeze")


def test_zipcache_on_device_decodes_like_the_cpu_cache():
    # The other seed method on the GPU: the same salient rows and key codes as the host cache (the
    # device groups each set's values over that set's rows, the host in token order), so the logits
    # differ by the values' rounding only. 300-token prompt: a block of 288 rows, then the window.
    seed_defaults = dict(zipcache_hi_bits=4, zipcache_lo_bits=2, zipcache_value_bits=4, zipcache_hi_fraction=0.2,
                         zipcache_group_size=32, zipcache_staging=128)  # the seed's split, whatever the defaults
    cpu, gpu, ref, got = cpu_and_gpu(dict(method="zipcache", **seed_defaults), seed=9)
    assert gpu.layers[0].state.on_device
    assert_logits_close(ref, got, 3e-2, "zipcache")
    for c, d in zip(cpu.stats(), gpu.stats()):
        assert d["tokens_kept"] == c["tokens_kept"] == 300
        assert d["figures"]["salient_tokens"] == 58  # ceil(288 * 0.2) rows of each head


def test_streaming_on_device_keeps_the_cpu_caches_rows():
    # No scores: the kept rows are the sinks and the newest tokens on both paths, exactly.
    cpu, gpu, ref, got = cpu_and_gpu(dict(method="streaming", streaming_budget=96), seed=6, batch=2)
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert c == d and len(d) == 2 * 2 * 96
    assert_logits_close(ref, got, 1e-3, "streaming")


def test_streaming_over_kivi_codes_on_device_keeps_the_cpu_caches_rows():
    # StreamingLLM over KIVI codes on the GPU: the sinks and the newest tokens, exactly as the CPU
    # cache keeps them, each erasure applied where the row lies in the device's groups; the codes
    # are the CPU cache's (tests/cuda), so the logits differ by the attention kernels' rounding.
    cfg = dict(method="streaming", streaming_budget=96, storage="kivi", kivi_bits=4, kivi_value_bits=2,
               kivi_group_size=32, kivi_staging=32)
    cpu, gpu, ref, got = cpu_and_gpu(cfg, seed=6, batch=2)
    for c, d in zip(kept_positions(cpu), kept_positions(gpu)):
        assert c == d and len(d) == 2 * 2 * 96
    assert_logits_close(ref, got, 1e-2, "streaming over kivi")
    for s in gpu.stats():
        assert s["tokens_kept"] == 96
        assert (s["figures"]["hi_bits"], s["figures"]["value_bits"]) == (4, 2)


def test_kivi_with_own_widths_and_long_groups_on_device_decodes_like_the_cpu_cache():
    # Keys at 4 bits, values at 2, groups of 64 rows: the device's codes are the CPU cache's bit for
    # bit (tests/cuda), so the logits differ by the attention kernels' rounding only.
    cfg = dict(method="kivi", kivi_bits=4, kivi_value_bits=2, kivi_group_size=64)
    cpu, gpu, ref, got = cpu_and_gpu(cfg, seed=8, batch=2)
    assert gpu.layers[0].state.on_device
    for s in gpu.stats():
        f = s["figures"]
        assert (f["kivi_key_bits"], f["kivi_value_bits"], f["kivi_group_size"]) == (4, 2, 64)
        assert f["compressed_groups"] == 4  # 300 prompt rows + 8 steps: 256 rows in groups of 64
    assert_logits_close(ref, got, 1e-2, "kivi K4V2 g64")


def eager_greedy(model, ids, cache, new):
    """Greedy tokens [B, new] decoded with one eager forward call per step."""
    with torch.no_grad():
        r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = r.logits[:, -1:].argmax(-1)
        out, logits = [nxt], []
        for _ in range(new - 1):
            r = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(r.logits[:, -1].float())
            nxt = r.logits[:, -1:].argmax(-1)
            out.append(nxt)
    return torch.cat(out, 1), torch.stack(logits)


@pytest.mark.parametrize("fields", [dict(method="full"), dict(method="kivi", kivi_bits=2, kivi_group_size=32),
                                    dict(method="kivi", kivi_bits=4), dict(method="kivi"),  # (default: K4V2, groups of 128)
                                    dict(method="h2o", h2o_budget=64), dict(method="pyramidkv", pyramidkv_budget=64),
                                    dict(method="streaming", streaming_budget=64),
                                    dict(method="zipcache", zipcache_group_size=32, zipcache_staging=128),
                                    # eviction over kivi codes: compressions (and re-packs) between replays
                                    dict(method="h2o", h2o_budget=64, storage="kivi", kivi_bits=4, kivi_value_bits=2,
                                         kivi_group_size=32, kivi_staging=32),
                                    dict(method="h2o", h2o_budget=96, storage="kivi"),
                                    # streaming over kivi codes: each step's row admitted on the device
                                    dict(method="streaming", streaming_budget=64, storage="kivi", kivi_bits=4,
                                         kivi_value_bits=2, kivi_group_size=32, kivi_staging=32),
                                    # eviction over zipcache codes: each compression's saliency chosen on the device
                                    dict(method="h2o", h2o_budget=64, storage="zipcache", zipcache_group_size=32,
                                         zipcache_staging=32)])
def test_graph_decoder_replays_the_eager_steps(fields):
    """GraphDecoder's replayed steps produce the eager steps' logits, across kivi's window flushes
    and zipcache's blocks (staging 128: the 170 steps cross one) and h2o's eviction of a row every step (its prompt cut to
    64 rows; pyramidkv: a budget per layer, tapered around 64). kvslim's kernels run with the same arguments (bit for bit in tests/cuda); the model's
    GEMMs may pick other cuBLAS kernels inside a capture, so an fp32 model, whose reordered sums
    differ by ~1e-6, keeps the comparison tight."""
    import kvslim.hf
    model = small_llama(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(3, 512, (2, 150), device="cuda", generator=g)
    new = 170
    kvslim.hf.prepare(model)
    try:
        cfg = kvslim.Config(device="cuda", **fields)
        ref_tokens, ref_logits = eager_greedy(model, ids, kvslim.hf.KVSlimCache(model, cfg), new)
        cache = kvslim.hf.KVSlimCache(model, cfg)
        dec = kvslim.hf.GraphDecoder(model, cache, max_tokens=ids.shape[1] + new)
        with torch.no_grad():
            r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = r.logits[:, -1:].argmax(-1)
        tokens, logits = [nxt], []
        for i in range(new - 1):
            step = dec.step(ref_tokens[:, i:i + 1])  # teacher-forced on the eager tokens: every step comparable
            logits.append(step[:, -1].float().clone())
            tokens.append(step[:, -1:].argmax(-1))
    finally:
        kvslim.hf.restore(model)
    # One eager step, then the graph; streaming over kivi codes takes the steps that compress its
    # window (one in kivi_staging) eagerly, as its CPU twin compresses before it attends.
    assert dec._step_graph is not None and dec._step_graph.steps + dec.eager_steps == new - 2
    over_codes = fields["method"] == "streaming" and fields.get("storage") == "kivi"
    assert (dec.eager_steps > 0) == over_codes and dec._step_graph.steps > 4 * dec.eager_steps
    torch.testing.assert_close(torch.stack(logits), ref_logits, atol=1e-4 * ref_logits.abs().max().item(), rtol=0)
    assert torch.equal(torch.cat(tokens, 1), ref_tokens)
    assert cache.get_seq_length() == ids.shape[1] + new - 1
    assert all(s["tokens_seen"] == ids.shape[1] + new - 1 for s in cache.stats())


def test_graph_decoder_generate_and_refusals():
    import kvslim.hf
    model = small_llama(torch.float32)
    ids = torch.randint(3, 512, (1, 64), device="cuda")
    kvslim.hf.prepare(model)
    try:
        cfg = kvslim.Config(method="kivi", kivi_bits=2, device="cuda")
        ref, _ = eager_greedy(model, ids, kvslim.hf.KVSlimCache(model, cfg), 40)
        dec = kvslim.hf.GraphDecoder(model, kvslim.hf.KVSlimCache(model, cfg), max_tokens=104)
        assert torch.equal(dec.generate(ids, 40), ref)
        dec.step(ref[:, -1:])  # the 104th token: the last max_tokens allows
        with pytest.raises(ValueError, match="max_tokens"):
            dec.step(ref[:, -1:])
        # An eviction cache below its budget: its probabilities would change shape every step.
        h2o = kvslim.hf.KVSlimCache(model, kvslim.Config(method="h2o", h2o_budget=100, device="cuda"))
        dec2 = kvslim.hf.GraphDecoder(model, h2o, max_tokens=200)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=h2o, use_cache=True)
        dec2.step(ref[:, :1])  # the eager step
        with pytest.raises(kvslim.InputError, match="budget"):
            dec2.step(ref[:, 1:2])
        with pytest.raises(ValueError, match="GPU memory"):
            kvslim.hf.GraphDecoder(model, kvslim.hf.KVSlimCache(model, kvslim.Config(method="kivi")), max_tokens=10)
    finally:
        kvslim.hf.restore(model)


@pytest.mark.parametrize("config", [dict(method="squeeze", squeeze_budget=96), dict(method="h2o", h2o_budget=96)])
def test_a_one_rank_nccl_group_decides_what_one_process_decides(config, tmp_path):
    # Issue 29 on one GPU: a KVSlimCache of device caches sharded over a 1-rank NCCL group (squeeze's
    # schedule and the cross-layer board gathered through NCCL on this GPU) against the same cache
    # without a group. One rank holds every head, so the budgets, kept rows and logits are the
    # process's own, to the bit; the gather must have run.
    import torch.distributed as dist
    import kvslim.distributed
    import kvslim.hf
    if not dist.is_nccl_available():
        pytest.skip("torch without NCCL")
    model = small_llama(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(11)
    ids = torch.randint(3, 512, (1, 300), device="cuda", generator=g)
    kvslim.hf.prepare(model)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        alone = kvslim.hf.KVSlimCache(model, kvslim.Config(device="cuda", **config))
        ref = step_logits(model, ids, alone, 8)
        sharded = kvslim.hf.KVSlimCache(model, kvslim.Config(device="cuda", **config))
        kv_heads = model.config.num_key_value_heads
        kvslim.distributed.shard(sharded.kvslim, (0, kv_heads), kv_heads)
        calls = []

        class CountingGather(kvslim.distributed.TensorParallel):
            def all_gather(self, local):
                calls.append(1)
                return super().all_gather(local)

        gather = CountingGather()
        sharded.kvslim.set_rank_gather(gather)
        got = step_logits(model, ids, sharded, 8)
    finally:
        dist.destroy_process_group()
        kvslim.hf.restore(model)
    assert gather._device.type == "cuda"
    assert calls, "the NCCL gather never ran"
    assert torch.equal(got, ref)
    budgets = lambda cache: [s["figures"].get("layer_budget") for s in cache.stats()]
    assert budgets(sharded) == budgets(alone)
    assert kept_positions(sharded) == kept_positions(alone)
