// Eviction on the device (cuda/device_eviction_cache.h) against the CPU's eviction caches: the
// same policy (the CPU's eviction core) over device slots. Given the same observations, the device
// cache keeps exactly the CPU cache's rows, in the same slot order, with the same fp16 bits, step
// after step (a prefill scored by its observation window, then decode steps one eviction each);
// its own attend's probabilities equal the CPU's within the kernels' tolerance; the cross-layer
// exchange and pyramidkv's per-layer budgets come through KVCacheBuilder; the device store shrinks
// to the budget after the prefill's eviction (the allocator's figure falls) and stays bounded.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_eviction_cache.h"
#include "cuda/device_packed_rows.h"
#include "kvslim/cuda.h"
#include "kvslim/errors.h"
#include "kvslim/kvslim.h"

namespace kvslim {
namespace {

using cuda::DeviceBuffer;

#define REQUIRE_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

std::vector<float> normal(std::size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

DeviceBuffer upload_f32(const std::vector<float>& x) {
  DeviceBuffer b;
  b.reserve(x.size() * 4);
  EXPECT_EQ(cudaMemcpy(b.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  return b;
}

std::vector<float> download_f32(const void* p, std::size_t n) {
  std::vector<float> x(n);
  EXPECT_EQ(cudaMemcpy(x.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return x;
}

// One model's layers on the CPU and on the device, driven with the same inputs; each step's
// observation is the CPU's probabilities, given to both (the device cache as device memory).
struct Twin {
  CacheSet cpu, gpu;
  std::size_t B, H, G, D;
  std::int64_t next = 0;
  std::mt19937 rng{7};
  double worst_probs = 0;  // max |device probs - CPU probs| seen
  double worst_out = 0;    // max |device out - CPU out| seen (caches that observe no attention)
  std::vector<float> key_offset;  // per layer, added to every key element (keys that share a direction)

  Twin(const KVCacheConfig& config, std::size_t layers, std::size_t b, std::size_t h, std::size_t g, std::size_t d)
      : B(b), H(h), G(g), D(d) {
    const ModelSpec spec = ModelSpec::uniform(static_cast<int>(layers), static_cast<int>(h), static_cast<int>(d));
    cpu = KVCacheBuilder::for_model(spec, config);
    KVCacheConfig on_gpu = config;
    on_gpu.device = "cuda";
    gpu = KVCacheBuilder::for_model(spec, on_gpu);
  }

  // Appends S tokens to every layer, attends with the observed queries (the last `needs` of them)
  // and observes, layer after layer (the order a model runs them).
  void step(std::size_t S) {
    std::vector<std::int64_t> pos(S);
    for (std::size_t i = 0; i < S; ++i) pos[i] = next + static_cast<std::int64_t>(i);
    next += static_cast<std::int64_t>(S);
    for (std::size_t l = 0; l < cpu.size(); ++l) {
      KVCache& c = cpu.at(l);
      KVCache& g = gpu.at(l);
      std::vector<float> k = normal(B * H * S * D, rng), v = normal(B * H * S * D, rng);
      for (std::size_t i = 0; i < k.size(); i += 53) k[i] *= 6.f;  // a few strong keys: uneven attention
      if (l < key_offset.size()) {
        for (auto& x : k) x += key_offset[l];
      }
      c.append(make_block(k.data(), B, H, S, D), make_block(v.data(), B, H, S, D), pos);
      DeviceBuffer dk = upload_f32(k), dv = upload_f32(v);
      g.append(KVBlock{dk.get(), DType::f32, B, H, S, D, MemorySpace::cuda, nullptr},
               KVBlock{dv.get(), DType::f32, B, H, S, D, MemorySpace::cuda, nullptr}, pos);
      const ObservationNeeds needs = c.needs();
      ASSERT_EQ(g.needs().attention, needs.attention);
      if (!needs.attention) {  // streaming: no observation; the two attend over the same rows
        ASSERT_EQ(g.rows(), c.rows());
        std::vector<float> q = normal(B * S * H * G * D, rng), out(B * S * H * G * D);
        c.attend(QueryBlock{q.data(), B, S, H * G, D}, pos, out.data());
        DeviceBuffer dq = upload_f32(q), dout;
        dout.reserve(out.size() * 4);
        g.attend(QueryBlock{dq.as<float>(), B, S, H * G, D, 0.f, MemorySpace::cuda, nullptr}, pos, dout.as<float>());
        const std::vector<float> go = download_f32(dout.get(), out.size());
        for (std::size_t i = 0; i < out.size(); ++i) worst_out = std::max(worst_out, double(std::fabs(go[i] - out[i])));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        continue;
      }
      const std::size_t Q = needs.attention_queries > 0 ? std::min(S, needs.attention_queries) : S;
      const std::vector<std::int64_t> qpos(pos.end() - static_cast<std::ptrdiff_t>(Q), pos.end());
      std::vector<float> q = normal(B * Q * H * G * D, rng);
      const std::size_t rows = c.rows();
      ASSERT_EQ(g.rows(), rows);
      std::vector<float> out(B * Q * H * G * D), probs(B * H * Q * rows);
      c.attend(QueryBlock{q.data(), B, Q, H * G, D}, qpos, out.data(), probs.data());
      DeviceBuffer dq = upload_f32(q), dout, dprobs;
      dout.reserve(out.size() * 4);
      dprobs.reserve(probs.size() * 4);
      g.attend(QueryBlock{dq.as<float>(), B, Q, H * G, D, 0.f, MemorySpace::cuda, nullptr}, qpos, dout.as<float>(),
               dprobs.as<float>());
      const std::vector<float> gp = download_f32(dprobs.get(), probs.size());
      for (std::size_t i = 0; i < probs.size(); ++i) worst_probs = std::max(worst_probs, double(std::fabs(gp[i] - probs[i])));
      c.observe_attention(AttentionObservation{probs.data(), B, H, Q, rows, rows, qpos});
      DeviceBuffer same = upload_f32(probs);
      g.observe_attention(AttentionObservation{same.as<float>(), B, H, Q, rows, rows, qpos, MemorySpace::cuda, nullptr});
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the step's device buffers die here
    }
  }

  // Every layer's rows: same count, positions in the same slot order, the same fp16 bits.
  void expect_same_rows(const std::string& when) {
    for (std::size_t l = 0; l < cpu.size(); ++l) {
      const CacheView c = cpu.at(l).materialize();
      const CacheView g = gpu.at(l).materialize();
      ASSERT_EQ(c.tokens, g.tokens) << when << " layer " << l;
      std::size_t pos_diff = 0, bit_diff = 0;
      for (std::size_t bh = 0; bh < B * H; ++bh) {
        for (std::size_t i = 0; i < c.tokens; ++i) {
          pos_diff += c.positions[bh * c.head_stride + i] != g.positions[bh * g.head_stride + i];
          for (std::size_t e = 0; e < D; ++e) {
            bit_diff += c.keys[(bh * c.head_stride + i) * D + e] != g.keys[(bh * g.head_stride + i) * D + e];
            bit_diff += c.values[(bh * c.head_stride + i) * D + e] != g.values[(bh * g.head_stride + i) * D + e];
          }
        }
      }
      EXPECT_EQ(pos_diff, 0u) << when << " layer " << l;
      EXPECT_EQ(bit_diff, 0u) << when << " layer " << l;
    }
  }

  // A model's life: a 300-token prompt (over the budget), 40 decode steps, then a 37-token call (a
  // question after the context); the rows compared after each.
  void prompt_decode_question(const std::string& what) {
    step(300);
    expect_same_rows(what + " after the prompt");
    for (int s = 0; s < 40; ++s) step(1);
    expect_same_rows(what + " after 40 decode steps");
    step(37);
    expect_same_rows(what + " after a second prompt");
  }
};

TEST(CudaEviction, KeepsTheCpuCachesRowsStepAfterStep) {
  REQUIRE_GPU();
  for (const std::size_t D : {64, 128}) {
    KVCacheConfig c;
    c.method = "h2o";
    c.h2o_budget = 96;
    Twin t(c, 2, 2, 2, 3, D);  // 2 layers (the cross-layer exchange), batch 2, 2 KV heads x 3 queries
    // The prompt scored by its last 16 queries, pooled, cut to 96 rows; one eviction per decode step.
    t.prompt_decode_question("h2o, D=" + std::to_string(D));
    EXPECT_LE(t.worst_probs, 2e-5) << "D=" << D;
    EXPECT_EQ(t.gpu.at(0).rows(), 96u);
    for (std::size_t l = 0; l < 2; ++l) EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << "D=" << D;
  }
}

KVCacheConfig h2o_over_kivi(int budget, int key_bits, int value_bits, int group, int staging);

// The first prompt is scored and cut on the device (device_prompt_scoring.h) with the core's
// arithmetic bit for bit, whatever the policy's prefill settings: decay, plain or normalised
// attention, pooling or none, the window or every query, the cross-layer exchange over 3 layers
// or none, sinks or none, pyramidkv's budgets per layer; over fp16 slots and kivi codes. The
// question's window (a second prompt) is the host's, from the device's mirrors.
TEST(CudaEviction, ThePromptIsScoredOnTheDeviceAsTheCoreScoresIt) {
  REQUIRE_GPU();
  struct Variant {
    const char* settings;
    bool kivi;
  };
  for (const Variant v : {Variant{"evict_decay=0.9", false}, Variant{"evict_scoring=attention", false},
                          Variant{"evict_pool_kernel=1", true}, Variant{"evict_obs_window=0", false},
                          Variant{"evict_cross_layer=0", true}, Variant{"evict_cross_layer=0.5,evict_decay=0.95", true},
                          Variant{"evict_scoring=attention,evict_pool_kernel=5", true}, Variant{"evict_recent_window=0", false}}) {
    KVCacheConfig c = v.kivi ? h2o_over_kivi(80, 4, 2, 32, 32) : KVCacheConfig{};
    c.method = "h2o";
    c.h2o_budget = 80;
    std::string rest = v.settings;  // "field=value,field=value"
    while (!rest.empty()) {
      const std::size_t comma = rest.find(','), eq = rest.find('=');
      const std::string item = rest.substr(0, comma);
      c.set(item.substr(0, eq), item.substr(eq + 1));
      rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    }
    const std::string what = std::string(v.settings) + (v.kivi ? " over kivi" : " over slots");
    Twin t(c, 3, 2, 2, 2, 64);
    t.prompt_decode_question(what);
    for (std::size_t l = 0; l < 3; ++l) EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << what << " layer " << l;
  }
  KVCacheConfig p;
  p.method = "pyramidkv";
  p.pyramidkv_budget = 96;
  Twin t(p, 3, 1, 2, 4, 128);
  t.prompt_decode_question("pyramidkv");
  for (std::size_t l = 0; l < 3; ++l) EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << "pyramidkv layer " << l;
}

// A NaN in a prompt's window is named as the host names it, and the cache is left as it was.
TEST(CudaEviction, ANonFinitePromptWeightIsNamedAndChangesNothing) {
  REQUIRE_GPU();
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 32;
  c.device = "cuda";
  const ModelSpec spec = ModelSpec::uniform(1, 2, 64);
  CacheSet set = KVCacheBuilder::for_model(spec, c);
  KVCache& g = set.at(0);
  std::mt19937 rng(3);
  const std::size_t S = 100, Q = 16;
  std::vector<float> k = normal(2 * S * 64, rng), v = normal(2 * S * 64, rng);
  std::vector<std::int64_t> pos(S);
  for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
  DeviceBuffer dk = upload_f32(k), dv = upload_f32(v);
  g.append(KVBlock{dk.get(), DType::f32, 1, 2, S, 64, MemorySpace::cuda, nullptr},
           KVBlock{dv.get(), DType::f32, 1, 2, S, 64, MemorySpace::cuda, nullptr}, pos);
  std::vector<float> probs(2 * Q * S, 1.f / S);
  probs[(1 * Q + 5) * S + 77] = NAN;
  DeviceBuffer dp = upload_f32(probs);
  const std::vector<std::int64_t> qpos(pos.end() - Q, pos.end());
  try {
    g.observe_attention(AttentionObservation{dp.as<float>(), 1, 2, Q, S, S, qpos, MemorySpace::cuda, nullptr});
    ADD_FAILURE() << "a NaN weight was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 0, head 1, query 5, token 77"), std::string::npos) << e.what();
  }
  EXPECT_EQ(g.rows(), S);
  EXPECT_EQ(g.stats().figure("prompts_on_device"), 0.0);
}

// A policy over kivi codes on the device (DevicePackedRows): h2o decides on the host from the
// device's probabilities, the rows live as the CPU's PackedRows blocks -- one quantization group a
// block, evicted rows leaving their group, the prompt's survivors compressed whole, decode rows
// once `staging` wait (whole groups, or one short group when staging < group). Given the same
// observations the device keeps the CPU cache's rows with the same decoded fp16 bits (so the same
// codes and parameters), and its attend over the codes reports the CPU's probabilities, in slot
// order (the store keeps padding inside its groups), within the CPU's own tolerance: the CPU's
// integer kernels over codes are within 2e-3 of float64 on probabilities (tests/kvslim/attend_test),
// the device's within 2e-5 (CudaCache tests).
constexpr double kCodesProbsTolerance = 2e-3;

// h2o keeping `budget` rows over kivi codes of these widths, group and staging.
KVCacheConfig h2o_over_kivi(int budget, int key_bits, int value_bits, int group, int staging) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  c.storage = "kivi";
  c.kivi_key_bits = key_bits;
  c.kivi_value_bits = value_bits;
  c.kivi_group_size = group;
  c.kivi_staging = staging;
  return c;
}

TEST(CudaEviction, KiviCodesUnderH2oKeepTheCpuCachesRowsAndCodes) {
  REQUIRE_GPU();
  struct Split {
    int key_bits, value_bits, group, staging;
  };
  for (const std::size_t D : {64, 128}) {
    for (const Split sp : {Split{4, 2, 32, 32}, Split{2, 2, 64, 64}, Split{4, 4, 128, 128}, Split{2, 4, 32, 16},
                           Split{8, 2, 32, 64}}) {
      const std::string what = "D=" + std::to_string(D) + " K" + std::to_string(sp.key_bits) + "V" +
                               std::to_string(sp.value_bits) + " g" + std::to_string(sp.group) + " staging " +
                               std::to_string(sp.staging);
      const KVCacheConfig c = h2o_over_kivi(96, sp.key_bits, sp.value_bits, sp.group, sp.staging);
      Twin t(c, 2, 2, 2, 3, D);
      t.prompt_decode_question(what);
      EXPECT_LE(t.worst_probs, kCodesProbsTolerance) << what;
      EXPECT_EQ(t.gpu.at(0).rows(), 96u) << what;
      // The decode steps were decided by the device kernel, the prompt's window by the device's
      // prompt scoring (each layer once), the question's by the host core.
      EXPECT_EQ(t.gpu.at(0).stats().figure("decode_steps_on_device"), 40.0) << what;
      for (std::size_t l = 0; l < 2; ++l) EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << what << " layer " << l;
    }
  }
}

// A long generation thins the groups (h2o evicts from old blocks, new ones keep forming): once a
// head's blocks hold under a quarter of the rows they were made with, it is re-packed -- decoded
// and quantized again in full groups, on the device as on the CPU -- and the rows stay the CPU's.
TEST(CudaEviction, KiviCodesAreRepackedAsTheCpuRepacksThem) {
  REQUIRE_GPU();
  KVCacheConfig c = h2o_over_kivi(64, 4, 2, 32, 32);
  c.evict_recent_window = 8;
  // Decayed scores: old rows lose their standing, so evictions reach back into old groups (without
  // decay h2o evicts the newest rows, which mostly leave from the window).
  c.evict_decay = 0.8;
  Twin t(c, 1, 1, 2, 2, 64);
  t.step(200);
  std::size_t repacks = 0;
  for (int s = 0; s < 600; ++s) {
    t.step(1);
    if (s % 100 == 99) t.expect_same_rows("h2o over kivi after " + std::to_string(s + 1) + " decode steps");
  }
  const auto& cache = dynamic_cast<const cuda::DeviceEvictionCache&>(t.gpu.at(0));
  const auto& store = dynamic_cast<const cuda::DevicePackedRows&>(cache.store());
  for (const auto& h : store.heads()) repacks += h.repacks;
  EXPECT_GT(repacks, 0u) << "no head was re-packed: the test no longer reaches the re-pack";
  EXPECT_EQ(t.gpu.at(0).stats().figure("decode_steps_on_device"), 600.0);
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// h2o keeping `budget` rows over zipcache codes: in each group the hi_fraction of rows with the
// largest key norms keep their keys at hi bits, the others at lo bits, values at value_bits.
KVCacheConfig h2o_over_zipcache(int budget, int hi, int lo, int value_bits, double fraction, int group, int staging) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  c.storage = "zipcache";
  c.zipcache_hi_bits = hi;
  c.zipcache_lo_bits = lo;
  c.zipcache_value_bits = value_bits;
  c.zipcache_hi_fraction = fraction;
  c.zipcache_group_size = group;
  c.zipcache_staging = staging;
  return c;
}

// A policy over zipcache codes on the device (DevicePackedRows with two sets: a group's salient rows
// in one region store, the others in another, the same region index): the group's salient rows
// chosen on the device as the CPU's saliency_mask chooses them, each set's keys quantized over its
// own rows, the values over the whole group. Given the same observations the device keeps the CPU
// cache's rows with the same decoded bits -- so the same salient rows, codes and parameters -- and
// reports its attention's probabilities in the CPU's slot order (token order inside a group, which
// the two sets interleave). Edges: every row salient (the lo set empty), none (the hi set empty), a
// window shorter than a group.
TEST(CudaEviction, ZipcacheCodesUnderH2oKeepTheCpuCachesRowsAndCodes) {
  REQUIRE_GPU();
  struct Split {
    int hi, lo, value_bits;
    double fraction;
    int group, staging;
  };
  for (const std::size_t D : {64, 128}) {
    for (const Split sp : {Split{4, 2, 4, 0.5, 32, 32}, Split{8, 2, 2, 0.3, 128, 128}, Split{4, 4, 2, 0.2, 64, 64},
                           Split{4, 2, 2, 1.0, 32, 32}, Split{4, 2, 2, 0.0, 32, 32}, Split{4, 2, 4, 0.5, 64, 16},
                           // groups of two units and more on the fp16 codes kernel, which skips a set's
                           // units of padding only: one set empty, one set whole
                           Split{4, 2, 2, 1.0, 64, 64}, Split{2, 2, 4, 0.0, 128, 128}}) {
      const std::string what = "D=" + std::to_string(D) + " hi " + std::to_string(sp.hi) + " lo " + std::to_string(sp.lo) +
                               " values " + std::to_string(sp.value_bits) + " fraction " + std::to_string(sp.fraction) +
                               " g" + std::to_string(sp.group) + " staging " + std::to_string(sp.staging);
      const KVCacheConfig c = h2o_over_zipcache(96, sp.hi, sp.lo, sp.value_bits, sp.fraction, sp.group, sp.staging);
      Twin t(c, 2, 2, 2, 3, D);
      t.prompt_decode_question(what);
      EXPECT_LE(t.worst_probs, kCodesProbsTolerance) << what;
      EXPECT_EQ(t.gpu.at(0).rows(), 96u) << what;
      EXPECT_EQ(t.gpu.at(0).stats().figure("decode_steps_on_device"), 40.0) << what;
      // Each block's salient rows: the hi_fraction of its rows (rounded up) when it was made, fewer
      // after evictions; the sets' counts add up to the block.
      const auto& cache = dynamic_cast<const cuda::DeviceEvictionCache&>(t.gpu.at(0));
      const auto& store = dynamic_cast<const cuda::DevicePackedRows&>(cache.store());
      EXPECT_EQ(store.kind(), "zipcache");
      std::size_t salient = 0, packed = 0;
      for (const auto& h : store.heads()) {
        for (const auto& b : h.blocks) {
          ASSERT_EQ(b.salient.size(), static_cast<std::size_t>(b.tokens)) << what;
          EXPECT_EQ(b.rows_in(0) + b.rows_in(1), b.tokens) << what;
          EXPECT_LE(b.rows_in(0), static_cast<int>(std::ceil(b.made * sp.fraction))) << what;
          salient += static_cast<std::size_t>(b.rows_in(0));
          packed += static_cast<std::size_t>(b.tokens);
        }
      }
      EXPECT_GT(packed, 0u) << what;
      if (sp.fraction == 0.0) {
        EXPECT_EQ(salient, 0u) << what;
      } else if (sp.fraction == 1.0) {
        EXPECT_EQ(salient, packed) << what;
      } else {
        EXPECT_GT(salient, 0u) << what;
      }
    }
  }
}

// Re-packs over zipcache codes keep each row's precision (the CPU's re-pack): decoded in token order
// from both sets, quantized again in full groups, each row back in its set.
TEST(CudaEviction, ZipcacheCodesAreRepackedAsTheCpuRepacksThem) {
  REQUIRE_GPU();
  KVCacheConfig c = h2o_over_zipcache(64, 4, 2, 4, 0.5, 32, 32);
  c.evict_recent_window = 8;
  c.evict_decay = 0.8;
  Twin t(c, 1, 1, 2, 2, 64);
  t.step(200);
  for (int s = 0; s < 600; ++s) {
    t.step(1);
    if (s % 100 == 99) t.expect_same_rows("h2o over zipcache after " + std::to_string(s + 1) + " decode steps");
  }
  const auto& cache = dynamic_cast<const cuda::DeviceEvictionCache&>(t.gpu.at(0));
  const auto& store = dynamic_cast<const cuda::DevicePackedRows&>(cache.store());
  std::size_t repacks = 0;
  for (const auto& h : store.heads()) repacks += h.repacks;
  EXPECT_GT(repacks, 0u) << "no head was re-packed: the test no longer reaches the re-pack";
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// pyramidkv over zipcache codes: its budgets per layer, each layer's first prompt scored and cut on
// the device (the scoring reads the logits, not the storage), the rows compressed into both sets.
TEST(CudaEviction, PyramidkvOverZipcacheCodesScoresThePromptOnTheDevice) {
  REQUIRE_GPU();
  KVCacheConfig c = h2o_over_zipcache(96, 4, 2, 4, 0.5, 32, 32);
  c.method = "pyramidkv";
  c.pyramidkv_budget = 96;
  Twin t(c, 3, 1, 2, 4, 128);
  t.prompt_decode_question("pyramidkv over zipcache");
  for (std::size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << "pyramidkv over zipcache layer " << l;
  }
  EXPECT_GT(t.gpu.at(0).rows(), t.gpu.at(2).rows());  // the taper: lower layers keep more
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// A head of more regions than one part of the slot order takes (512 rows of a set a part: 16 regions
// of 32 rows): the prompt's probabilities and each decode step's are put in slot order part by part,
// every region's slots after the live rows of all the regions before it.
TEST(CudaEviction, ZipcacheCodesOverManyRegionsKeepTheirSlotOrder) {
  REQUIRE_GPU();
  const KVCacheConfig c = h2o_over_zipcache(1100, 4, 2, 4, 0.5, 32, 32);
  Twin t(c, 1, 1, 2, 2, 64);
  t.step(1600);
  t.expect_same_rows("h2o 1100 over zipcache g32 after a 1,600-row prompt");
  for (int s = 0; s < 30; ++s) t.step(1);
  t.expect_same_rows("h2o 1100 over zipcache g32 after 30 decode steps");
  const auto& cache = dynamic_cast<const cuda::DeviceEvictionCache&>(t.gpu.at(0));
  const auto& store = dynamic_cast<const cuda::DevicePackedRows&>(cache.store());
  EXPECT_GT(store.heads().at(0).blocks.size(), 32u) << "fewer than three parts: the test no longer spans them";
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// squeeze over zipcache codes -- both seeds in one cache, on the device -- and streaming over them.
TEST(CudaEviction, SqueezeAndStreamingOverZipcacheCodesKeepTheCpuRows) {
  REQUIRE_GPU();
  {
    KVCacheConfig c;
    c.method = "squeeze";
    c.squeeze_budget = 96;
    c.storage = "zipcache";
    c.zipcache_group_size = 32;
    c.zipcache_staging = 32;
    Twin t(c, 4, 2, 2, 3, 128);
    t.key_offset = {0.f, 0.3f, 1.f, 3.f};
    t.step(300);
    for (int s = 0; s < 30; ++s) t.step(1);
    t.expect_same_rows("squeeze over zipcache after the prompt and 30 steps");
    EXPECT_GT(t.gpu.at(0).rows(), t.gpu.at(3).rows());
    EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
  }
  for (const std::size_t D : {64, 128}) {
    KVCacheConfig c;
    c.method = "streaming";
    c.streaming_budget = 80;
    c.storage = "zipcache";
    c.zipcache_group_size = 32;
    c.zipcache_staging = 32;
    Twin t(c, 2, 2, 2, 3, D);
    const std::string what = "streaming over zipcache, D=" + std::to_string(D);
    t.prompt_decode_question(what);
    for (int s = 0; s < 150; ++s) t.step(1);
    t.expect_same_rows(what + " after 150 more decode steps");
    EXPECT_EQ(t.gpu.at(1).rows(), 80u);
    EXPECT_LE(t.worst_out, kCodesProbsTolerance) << what;
    EXPECT_EQ(t.gpu.at(0).stats().figure("decode_steps_on_device"), 190.0) << what;
  }
}

// squeeze over kivi codes: the schedule's budgets (device key signal) and the CPU's rows.
// squeeze keeping 96 rows on average over 4 layers whose keys differ in spread (the schedule moves
// budget toward the broad ones): `fields` set on top.
Twin squeeze_twin(const std::function<void(KVCacheConfig&)>& fields) {
  KVCacheConfig c;
  c.method = "squeeze";
  c.squeeze_budget = 96;
  fields(c);
  Twin t(c, 4, 2, 2, 3, 128);
  t.key_offset = {0.f, 0.3f, 1.f, 3.f};
  return t;
}

TEST(CudaEviction, SqueezeOverKiviCodesKeepsTheCpuRows) {
  REQUIRE_GPU();
  Twin t = squeeze_twin([](KVCacheConfig& c) { c.storage = "kivi"; });
  t.step(300);
  for (int s = 0; s < 30; ++s) t.step(1);
  t.expect_same_rows("squeeze over kivi after the prompt and 30 steps");
  EXPECT_GT(t.gpu.at(0).rows(), t.gpu.at(3).rows());
  // The held prompt's rows were cut in the window on the device (DevicePackedRows::drop_lowest_on_device),
  // each layer's prompt scored there first (the key dispersion is its layer signal).
  double on_device = 0;
  for (std::size_t l = 0; l < 4; ++l) {
    on_device += t.gpu.at(l).stats().figure("trims_on_device");
    EXPECT_EQ(t.gpu.at(l).stats().figure("prompts_on_device"), 1.0) << "layer " << l;
  }
  EXPECT_GE(on_device, 3.0);
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// A decode step over thousands of rows per head splits each head's observation across CTAs (the
// last part to finish picks the victim among the parts' candidates): the same rows as the CPU cache.
TEST(CudaEviction, KeepsTheCpuCachesRowsWhenAStepSplitsEachHead) {
  REQUIRE_GPU();
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 2500;  // 2,501 rows a step: 5 parts per head at batch 2 x 2 heads
  Twin t(c, 1, 2, 2, 3, 128);
  t.step(3000);
  t.expect_same_rows("h2o 2500 after the prompt");
  for (int s = 0; s < 40; ++s) t.step(1);
  t.expect_same_rows("h2o 2500 after 40 decode steps");
  EXPECT_EQ(t.gpu.at(0).rows(), 2500u);
  EXPECT_LE(t.worst_probs, 2e-5);
}

// The same over kivi codes with parts of several chunks: 20,001 rows a step over 2 heads make 16
// parts of ~1,250 rows, each scored in two chunks of 1,024 (observe_packed_kernel), the last part's
// second chunk reaching the window.
TEST(CudaEviction, KiviCodesKeepTheCpuRowsWhenEachPartScoresSeveralChunks) {
  REQUIRE_GPU();
  KVCacheConfig c = h2o_over_kivi(20000, 4, 2, 128, 128);
  c.evict_decay = 0.9;  // old rows lose standing: victims come from the groups, not only the window
  Twin t(c, 1, 1, 2, 3, 128);
  t.step(20500);
  t.expect_same_rows("h2o 20000 over kivi after the prompt");
  for (int s = 0; s < 40; ++s) t.step(1);
  t.expect_same_rows("h2o 20000 over kivi after 40 decode steps");
  EXPECT_EQ(t.gpu.at(0).rows(), 20000u);
  EXPECT_EQ(t.gpu.at(0).stats().figure("decode_steps_on_device"), 40.0);
  EXPECT_LE(t.worst_probs, kCodesProbsTolerance);
}

// streaming: the core admits each appended row on the host (sinks, then the newest), and the rows
// move on the device to the slots it gives them: the CPU cache's rows, in its slot order.
TEST(CudaEviction, StreamingKeepsTheCpuCachesRows) {
  REQUIRE_GPU();
  for (const std::size_t D : {64, 128}) {
    KVCacheConfig c;
    c.method = "streaming";
    c.streaming_budget = 80;
    Twin t(c, 2, 2, 2, 3, D);
    t.prompt_decode_question("streaming, D=" + std::to_string(D));  // the prompt: 4 sinks + the newest 76
    t.step(50);  // a third call over the budget
    t.expect_same_rows("streaming after a third call, D=" + std::to_string(D));
    EXPECT_EQ(t.gpu.at(1).rows(), 80u);
    EXPECT_LE(t.worst_out, 5e-4) << "D=" << D;  // a wrong row moves the outputs by ~1e-2
    // The prompt's rows above the budget were given back: the store holds budget + 1 rows,
    // rounded to whole units of 16.
    const auto st = t.gpu.at(0).stats();
    double dev = 0;
    for (const auto& [name, value] : st.figures) {
      if (name == "device_bytes") dev = value;
    }
    EXPECT_LE(dev, double(2 * 2 * 96 * (2 * D * 2 + 8 + 4)));
  }
}

// streaming over kivi codes: the core erases each victim where it lies on the device (a group closed
// up, a window row masked) as a call's rows arrive, and a decode step at the budget is admitted by
// the device (the decode observation by position, the host's metadata pulled back before the next
// call); the rows, decoded from the same codes, and the attention over them equal the CPU cache's,
// which writes its rows itself, through groups emptied by the sliding window and blocks compressed
// every `staging` rows.
TEST(CudaEviction, StreamingOverKiviCodesKeepsTheCpuCachesRows) {
  REQUIRE_GPU();
  struct Split {
    int key_bits, value_bits, group, staging;
  };
  for (const std::size_t D : {64, 128}) {
    for (const Split sp : {Split{4, 2, 32, 32}, Split{2, 2, 64, 64}, Split{4, 4, 32, 16}}) {
      const std::string what = "D=" + std::to_string(D) + " K" + std::to_string(sp.key_bits) + "V" +
                               std::to_string(sp.value_bits) + " g" + std::to_string(sp.group) + " staging " +
                               std::to_string(sp.staging);
      KVCacheConfig c = h2o_over_kivi(80, sp.key_bits, sp.value_bits, sp.group, sp.staging);
      c.method = "streaming";
      c.streaming_budget = 80;
      Twin t(c, 2, 2, 2, 3, D);
      t.prompt_decode_question(what);  // the prompt: 4 sinks + the newest 76
      for (int s = 0; s < 150; ++s) t.step(1);
      t.expect_same_rows(what + " after 150 more decode steps");
      t.step(50);
      t.expect_same_rows(what + " after a third call");
      EXPECT_EQ(t.gpu.at(1).rows(), 80u) << what;
      EXPECT_LE(t.worst_out, kCodesProbsTolerance) << what;
      const CacheStats st = t.gpu.at(0).stats();
      // Each decode step at the budget is admitted on the device (the observation by position).
      EXPECT_EQ(st.figure("decode_steps_on_device"), 190.0) << what;
    }
  }
}

double figure(const CacheStats& st, const std::string& name) {
  for (const auto& [n, v] : st.figures) {
    if (n == name) return v;
  }
  ADD_FAILURE() << "no figure " << name;
  return 0;
}

// squeeze on the device: the host cache's schedule (SqueezeSchedule) with its key signal measured
// by a kernel over the prompt's keys. Both sets resolve the same per-layer budgets from the same
// concentrations (the device's within rounding of the host's double sums), then keep the same rows.
TEST(CudaEviction, SqueezeResolvesTheCpuBudgetsAndKeepsTheCpuRows) {
  REQUIRE_GPU();
  for (const std::string prefill : {"deferred", "eager"}) {
    Twin t = squeeze_twin([&](KVCacheConfig& c) { c.squeeze_prefill = prefill; });
    t.step(300);
    for (int s = 0; s < 6; ++s) t.step(1);  // the deferred layers adopt at their next call
    t.expect_same_rows("squeeze (" + prefill + ") after the prompt and 6 steps");
    for (std::size_t l = 0; l < 4; ++l) {
      const CacheStats cs = t.cpu.at(l).stats(), gs = t.gpu.at(l).stats();
      EXPECT_NEAR(figure(gs, "concentration"), figure(cs, "concentration"), 1e-6) << prefill << " layer " << l;
      EXPECT_EQ(figure(gs, "rebudgeted"), 1.0) << prefill << " layer " << l;
      EXPECT_EQ(t.gpu.at(l).rows(), t.cpu.at(l).rows()) << prefill << " layer " << l;
    }
    EXPECT_GT(t.gpu.at(0).rows(), t.gpu.at(3).rows()) << prefill;  // broad keys keep more than aligned ones
    if (prefill == "deferred") {
      // The layers that held the whole prompt cut it to their budget on the device (select_lowest:
      // no metadata read back), the last one right after its prompt finalised the schedule.
      double on_device = 0;
      for (std::size_t l = 0; l < 4; ++l) on_device += figure(t.gpu.at(l).stats(), "trims_on_device");
      EXPECT_GE(on_device, 3.0);
    }
    // Every layer's prompt was scored (and cut to its limit) on the device: the key dispersion,
    // measured at the append, is the layer signal.
    for (std::size_t l = 0; l < 4; ++l) {
      EXPECT_EQ(figure(t.gpu.at(l).stats(), "prompts_on_device"), 1.0) << prefill << " layer " << l;
    }
    for (int s = 0; s < 20; ++s) t.step(1);
    t.expect_same_rows("squeeze (" + prefill + ") after 26 steps");
    EXPECT_LE(t.worst_probs, 2e-5);
  }
  // A layer signal read from the prompt's probabilities (the attention's entropy) stays on the host:
  // its prompt is decided there, with the same rows and budgets as the CPU cache.
  Twin t = squeeze_twin([](KVCacheConfig& c) { c.squeeze_signal = "attention_entropy"; });
  t.step(300);
  for (int s = 0; s < 6; ++s) t.step(1);
  t.expect_same_rows("squeeze (attention entropy) after the prompt and 6 steps");
  for (std::size_t l = 0; l < 4; ++l) {
    const CacheStats cs = t.cpu.at(l).stats(), gs = t.gpu.at(l).stats();
    EXPECT_NEAR(figure(gs, "concentration"), figure(cs, "concentration"), 1e-6) << "entropy layer " << l;
    EXPECT_EQ(figure(gs, "prompts_on_device"), 0.0) << "entropy layer " << l;
  }
}

TEST(CudaEviction, PyramidBudgetsPerLayerComeThroughTheBuilder) {
  REQUIRE_GPU();
  KVCacheConfig c;
  c.method = "pyramidkv";
  c.pyramidkv_budget = 128;
  Twin t(c, 4, 1, 2, 4, 128);
  t.step(512);
  for (int s = 0; s < 8; ++s) t.step(1);
  t.expect_same_rows("pyramidkv");
  EXPECT_GT(t.gpu.at(0).rows(), t.gpu.at(3).rows());  // the taper: lower layers keep more
}

TEST(CudaEviction, ThePrefillsEvictionGivesTheMemoryBack) {
  REQUIRE_GPU();
  const std::size_t B = 1, H = 8, D = 128, prompt = 8192, budget = 1024;
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = static_cast<int>(budget);
  c.device = "cuda";
  auto gpu = KVCacheFactory::create(c);
  std::mt19937 rng(3);
  const std::vector<float> k = normal(B * H * prompt * D, rng), v = normal(B * H * prompt * D, rng);
  DeviceBuffer dk = upload_f32(k), dv = upload_f32(v);
  std::vector<std::int64_t> pos(prompt);
  for (std::size_t i = 0; i < prompt; ++i) pos[i] = static_cast<std::int64_t>(i);
  gpu->append(KVBlock{dk.get(), DType::f32, B, H, prompt, D, MemorySpace::cuda, nullptr},
              KVBlock{dv.get(), DType::f32, B, H, prompt, D, MemorySpace::cuda, nullptr}, pos);
  const double before = gpu->stats().figure("device_bytes");
  const std::size_t Q = 16, G = 4;
  const std::vector<float> q = normal(B * Q * H * G * D, rng);
  DeviceBuffer dq = upload_f32(q), out, probs;
  out.reserve(q.size() * 4);
  probs.reserve(B * H * Q * prompt * 4);
  const std::vector<std::int64_t> qpos(pos.end() - Q, pos.end());
  gpu->attend(QueryBlock{dq.as<float>(), B, Q, H * G, D, 0.f, MemorySpace::cuda, nullptr}, qpos, out.as<float>(),
              probs.as<float>());
  // The device cache's own probabilities, as a caller passes them (no copy through the host).
  gpu->observe_attention(AttentionObservation{probs.as<float>(), B, H, Q, prompt, prompt, qpos, MemorySpace::cuda, nullptr});
  const double per_row = B * H * (D * 2 * 2 + 8 + 4 + 4);  // K, V, position, score, exposure
  const double after = gpu->stats().figure("device_bytes");
  EXPECT_GE(before, per_row * prompt);
  EXPECT_LE(after, per_row * (budget + 1 + 16));
  EXPECT_EQ(gpu->rows(), budget);
  // Decode steps: one row in, one out, the store never grows past budget + 1 rows.
  DeviceBuffer sk = upload_f32(normal(B * H * D, rng)), sv = upload_f32(normal(B * H * D, rng));
  DeviceBuffer sq = upload_f32(normal(B * H * G * D, rng));
  for (std::size_t s = 0; s < 200; ++s) {
    const std::int64_t p = static_cast<std::int64_t>(prompt + s);
    gpu->append(KVBlock{sk.get(), DType::f32, B, H, 1, D, MemorySpace::cuda, nullptr},
                KVBlock{sv.get(), DType::f32, B, H, 1, D, MemorySpace::cuda, nullptr}, std::vector<std::int64_t>{p});
    gpu->attend(QueryBlock{sq.as<float>(), B, 1, H * G, D, 0.f, MemorySpace::cuda, nullptr}, std::vector<std::int64_t>{p},
                out.as<float>(), probs.as<float>());
    gpu->observe_attention(AttentionObservation{probs.as<float>(), B, H, 1, budget + 1, budget + 1,
                                                std::vector<std::int64_t>{p}, MemorySpace::cuda, nullptr});
  }
  EXPECT_EQ(gpu->rows(), budget);
  EXPECT_LE(gpu->stats().figure("device_bytes"), per_row * (budget + 1 + 16));
  // Every head keeps the newest position (inside the recent window) and distinct positions.
  const CacheView view = gpu->materialize();
  for (std::size_t bh = 0; bh < B * H; ++bh) {
    std::vector<std::int64_t> kept(view.positions + bh * view.head_stride, view.positions + bh * view.head_stride + view.tokens);
    std::sort(kept.begin(), kept.end());
    EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());
    EXPECT_EQ(kept.back(), static_cast<std::int64_t>(prompt + 199));
  }
}

// h2o keeping 1,024 of 8,192 rows per head, over fp16 slots and over kivi codes (keys 4 bits, values
// 2, groups of 128): the device bytes after the prompt's eviction and after 200 decode steps (one
// row in, one out). Codes + parameters + positions are ~112 bytes a row against the slots' 528; the
// kivi window (up to `staging` fp16 rows a head, the CPU's too) adds the rest.
TEST(CudaEviction, KiviCodesHoldAFractionOfTheSlotsBytes) {
  REQUIRE_GPU();
  const std::size_t B = 1, H = 8, D = 128, G = 4, prompt = 8192, budget = 1024;
  std::mt19937 rng(3);
  const std::vector<float> k = normal(B * H * prompt * D, rng), v = normal(B * H * prompt * D, rng);
  const std::vector<float> q = normal(B * 16 * H * G * D, rng);
  double bytes[2][2] = {};  // [fp16, kivi][after the prompt, after the decode steps]
  for (int kivi = 0; kivi < 2; ++kivi) {
    KVCacheConfig c;
    c.method = "h2o";
    c.h2o_budget = static_cast<int>(budget);
    c.device = "cuda";
    if (kivi) {
      c.storage = "kivi";
      c.kivi_key_bits = 4;
      c.kivi_value_bits = 2;
      c.kivi_group_size = 128;
      c.kivi_staging = 128;
    }
    auto gpu = KVCacheFactory::create(c);
    DeviceBuffer dk = upload_f32(k), dv = upload_f32(v), dq = upload_f32(q), out, probs;
    std::vector<std::int64_t> pos(prompt);
    for (std::size_t i = 0; i < prompt; ++i) pos[i] = static_cast<std::int64_t>(i);
    gpu->append(KVBlock{dk.get(), DType::f32, B, H, prompt, D, MemorySpace::cuda, nullptr},
                KVBlock{dv.get(), DType::f32, B, H, prompt, D, MemorySpace::cuda, nullptr}, pos);
    out.reserve(q.size() * 4);
    probs.reserve(B * H * 16 * prompt * 4);
    const std::vector<std::int64_t> qpos(pos.end() - 16, pos.end());
    gpu->attend(QueryBlock{dq.as<float>(), B, 16, H * G, D, 0.f, MemorySpace::cuda, nullptr}, qpos, out.as<float>(),
                probs.as<float>());
    gpu->observe_attention(AttentionObservation{probs.as<float>(), B, H, 16, prompt, prompt, qpos, MemorySpace::cuda, nullptr});
    bytes[kivi][0] = gpu->stats().figure("device_bytes");
    for (std::size_t s = 0; s < 200; ++s) {
      const std::int64_t p = static_cast<std::int64_t>(prompt + s);
      gpu->append(KVBlock{dk.get(), DType::f32, B, H, 1, D, MemorySpace::cuda, nullptr},
                  KVBlock{dv.get(), DType::f32, B, H, 1, D, MemorySpace::cuda, nullptr}, std::vector<std::int64_t>{p});
      gpu->attend(QueryBlock{dq.as<float>(), B, 1, H * G, D, 0.f, MemorySpace::cuda, nullptr}, std::vector<std::int64_t>{p},
                  out.as<float>(), probs.as<float>());
      gpu->observe_attention(AttentionObservation{probs.as<float>(), B, H, 1, budget + 1, budget + 1,
                                                  std::vector<std::int64_t>{p}, MemorySpace::cuda, nullptr});
    }
    EXPECT_EQ(gpu->rows(), budget) << (kivi ? "kivi" : "fp16");
    // Every decode step decided on the device, from the probabilities attend left over the rows it
    // spanned (the cache's own: no reorder).
    EXPECT_EQ(gpu->stats().figure("decode_steps_on_device"), 200.0) << (kivi ? "kivi" : "fp16");
    bytes[kivi][1] = gpu->stats().figure("device_bytes");
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::printf("h2o 1024 of 8192 rows, device bytes: fp16 slots %.0f / %.0f, kivi K4V2 g128 %.0f / %.0f (after the prompt / "
              "200 decode steps): %.3f / %.3f of the slots\n",
              bytes[0][0], bytes[0][1], bytes[1][0], bytes[1][1], bytes[1][0] / bytes[0][0], bytes[1][1] / bytes[0][1]);
  EXPECT_LT(bytes[1][0], 0.35 * bytes[0][0]);
  EXPECT_LT(bytes[1][1], 0.45 * bytes[0][1]);  // the window then holds up to 128 fp16 rows a head
}

TEST(CudaEviction, AnUnobservedAppendIsAClearError) {
  REQUIRE_GPU();
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 32;
  c.device = "cuda";
  auto gpu = KVCacheFactory::create(c);
  std::mt19937 rng(5);
  DeviceBuffer k = upload_f32(normal(2 * 40 * 64, rng));
  gpu->append(KVBlock{k.get(), DType::f32, 1, 2, 40, 64, MemorySpace::cuda, nullptr},
              KVBlock{k.get(), DType::f32, 1, 2, 40, 64, MemorySpace::cuda, nullptr});
  try {
    gpu->append(KVBlock{k.get(), DType::f32, 1, 2, 1, 64, MemorySpace::cuda, nullptr},
                KVBlock{k.get(), DType::f32, 1, 2, 1, 64, MemorySpace::cuda, nullptr});
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("never observed"), std::string::npos) << e.what();
  }
  // An observation of the wrong shape names both shapes.
  DeviceBuffer p;
  p.reserve(2 * 39 * 4);
  const std::vector<std::int64_t> qpos{39};
  EXPECT_THROW(gpu->observe_attention(AttentionObservation{p.as<float>(), 1, 2, 1, 39, 39, qpos, MemorySpace::cuda, nullptr}),
               InputError);
}

}  // namespace
}  // namespace kvslim
