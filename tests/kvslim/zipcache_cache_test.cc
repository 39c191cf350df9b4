// zipcache and kivi caches: the original's tests/cache/test_zipcache_cache.py inventory
// (seed-behaviour.md §5.4) where it makes sense in C++, plus what kvslim adds: a resident state that
// is really compressed, the staging window, true positions, attention saliency, input errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cache/zipcache_cache.h"
#include "kvslim/dtype.h"
#include "kvslim/errors.h"
#include "kvslim/factory.h"
#include "kvslim/zipcache.h"

namespace kvslim {
namespace {

// fp16 [B, H, S, D] gaussian values.
std::vector<std::uint16_t> fp16_data(std::size_t b, std::size_t h, std::size_t s, std::size_t d, unsigned seed,
                                     float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<std::uint16_t> v(b * h * s * d);
  for (auto& x : v) x = f32_to_fp16(dist(rng));
  return v;
}

// The seed's documented configuration (seed-behaviour.md §4: 20 % salient, groups of 32 rows), which
// these tests hold the cache to; kvslim's defaults moved in issue 27.
KVCacheConfig zip_config(int staging = 0) {
  KVCacheConfig c;
  c.method = "zipcache";
  c.zipcache_hi_fraction = 0.2;
  c.zipcache_group_size = 32;
  c.zipcache_staging = staging;
  return c;
}

double cosine_fp16(const std::uint16_t* a, const std::uint16_t* b, std::size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = fp16_to_f32(a[i]), y = fp16_to_f32(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  return ab / std::sqrt(aa * bb);
}

struct Io {
  std::vector<std::uint16_t> k, v;
  KVBlock kb, vb;
  Io(std::size_t b, std::size_t h, std::size_t s, std::size_t d, unsigned seed)
      : k(fp16_data(b, h, s, d, seed)), v(fp16_data(b, h, s, d, seed + 1000)) {
    kb = make_block_fp16(k.data(), b, h, s, d);
    vb = make_block_fp16(v.data(), b, h, s, d);
  }
};

TEST(ZipCacheCache, FactoryDispatch) {
  EXPECT_EQ(KVCacheFactory::create(zip_config())->method(), "zipcache");
  KVCacheConfig c;
  c.method = "kivi";
  EXPECT_EQ(KVCacheFactory::create(c)->method(), "kivi");
}

TEST(ZipCacheCache, ReportsEffectiveAvgBits) {
  auto cache = KVCacheFactory::create(zip_config());
  EXPECT_EQ(cache->stats().figure("effective_avg_bits"), 4.0);  // hi_bits before any data, as the original
  Io io(1, 2, 64, 128, 1);
  cache->update_and_fetch(io.kb, io.vb);
  EXPECT_TRUE(cache->stats().has_figure("effective_avg_bits"));
  EXPECT_FALSE(cache->stats().has_figure("bits"));
}

TEST(ZipCacheCache, OutputShapePreservedAndQualityBounded) {
  for (int staging : {0, 32, 128}) {
    auto cache = KVCacheFactory::create(zip_config(staging));
    Io io(1, 2, 64, 128, 2);
    const CacheView v = cache->update_and_fetch(io.kb, io.vb);
    EXPECT_EQ(v.batch, 1u);
    EXPECT_EQ(v.heads, 2u);
    EXPECT_EQ(v.tokens, 64u);
    EXPECT_EQ(v.head_dim, 128u);
    EXPECT_GT(cosine_fp16(v.keys, io.k.data(), io.k.size()), 0.9);
    EXPECT_GT(cosine_fp16(v.values, io.v.data(), io.v.size()), 0.995);  // values at uniform 4 bits
  }
}

TEST(ZipCacheCache, AccountedBytesOfTheOriginal) {
  auto cache = KVCacheFactory::create(zip_config(0));
  Io io(1, 2, 64, 128, 3);
  cache->update_and_fetch(io.kb, io.vb);
  const CacheStats st = cache->stats();
  // Per head: keys 4064 (§4.3), values all-hi 5184; two heads.
  EXPECT_EQ(st.figure("accounted_key_bytes"), 2 * 4064.0);
  EXPECT_EQ(st.figure("accounted_value_bytes"), 2 * 5184.0);
  EXPECT_EQ(st.accounted_bytes, 2 * (4064.0 + 5184.0));
  EXPECT_EQ(st.figure("baseline_key_bytes"), 2 * 3072.0);
  EXPECT_GE(st.figure("accounted_key_bytes"), st.figure("baseline_key_bytes"));  // >= all-lo baseline
  EXPECT_LT(st.figure("accounted_key_bytes"), st.figure("fp16_key_bytes"));     // < fp16
  EXPECT_NEAR(st.figure("compression_ratio_keys"), 16384.0 / 4064.0, 1e-12);   // 4.03
  EXPECT_NEAR(st.figure("effective_avg_bits"), 3.969, 5e-4);
  EXPECT_GE(st.figure("effective_avg_bits"), 2.0);
  EXPECT_LE(st.figure("effective_avg_bits"), 4.0);
}

TEST(ZipCacheCache, ResidentBytesAreTheCompressedBuffers) {
  auto cache = KVCacheFactory::create(zip_config(0));
  Io io(1, 2, 64, 128, 4);
  cache->update_and_fetch(io.kb, io.vb);
  const auto& zc = dynamic_cast<const ZipCacheCache&>(*cache);
  std::size_t keys = 0, values = 0, blocks = 0;
  for (const auto& head : zc.heads()) {
    for (const auto& b : head.blocks) {
      keys += b.keys.mask_bits.size() + b.keys.hi.codes.size() + b.keys.lo.codes.size() +
              2 * (b.keys.hi.scale.size() + b.keys.hi.zero.size() + b.keys.lo.scale.size() + b.keys.lo.zero.size());
      values += b.values.codes.size() + 2 * (b.values.scale.size() + b.values.zero.size());
      ++blocks;
    }
    keys += 2 * head.stage_keys.capacity();
    values += 2 * head.stage_values.capacity();
  }
  EXPECT_EQ(blocks, 2u);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("resident_key_bytes"), double(keys));
  EXPECT_EQ(st.figure("resident_value_bytes"), double(values));
  EXPECT_EQ(keys, 2u * 4008u);    // 13 rows at 4 bits + 51 at 2 bits, fp16 params, 8-byte mask
  EXPECT_EQ(values, 2u * 5120u);  // 64 rows at 4 bits, 2 groups of fp16 params
  // The rest is bookkeeping: positions (8 bytes a token) and the block lists.
  EXPECT_GE(st.resident_bytes, keys + values + 64 * 8);
  EXPECT_LE(st.resident_bytes, keys + values + 64 * 8 + 4 * sizeof(ZipCacheCache::Block) + 2 * sizeof(ZipCacheCache::Head));
  EXPECT_LT(st.resident_bytes, st.kept_fp16_bytes);
  EXPECT_NEAR(st.compression_ratio, double(st.seen_fp16_bytes) / st.resident_bytes, 1e-12);
  EXPECT_GT(st.compression_ratio, 3.0);
  EXPECT_GT(st.view_bytes, 0u);
}

TEST(ZipCacheCache, ResidentBelowFp16ForEveryWholeGroupPrefill) {
  for (std::size_t S : {32u, 64u, 96u, 256u}) {
    KVCacheConfig c = zip_config(32);
    auto cache = KVCacheFactory::create(c);
    Io io(2, 2, S, 64, static_cast<unsigned>(S));
    cache->update_and_fetch(io.kb, io.vb);
    const CacheStats st = cache->stats();
    EXPECT_EQ(st.figure("staging_tokens"), 0.0) << S;
    EXPECT_LT(st.resident_bytes, st.kept_fp16_bytes) << S;
  }
}

TEST(ZipCacheCache, ValuesOffPassThroughLosslessly) {
  KVCacheConfig c = zip_config(0);
  c.zipcache_quantize_values = false;
  auto cache = KVCacheFactory::create(c);
  Io io(1, 2, 64, 128, 5);
  const CacheView v = cache->update_and_fetch(io.kb, io.vb);
  EXPECT_EQ(std::vector<std::uint16_t>(v.values, v.values + io.v.size()), io.v);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("accounted_value_bytes"), 0.0);
  EXPECT_GT(st.seen_fp16_bytes, 0u);
  EXPECT_EQ(st.figure("resident_value_bytes"), double(io.v.size() * 2));
}

TEST(ZipCacheCache, EdgeFractions) {
  for (double hf : {0.0, 1.0}) {
    KVCacheConfig c = zip_config(0);
    c.zipcache_hi_fraction = hf;
    auto cache = KVCacheFactory::create(c);
    Io io(1, 2, 64, 128, 6);
    EXPECT_EQ(cache->update_and_fetch(io.kb, io.vb).tokens, 64u);
  }
}

TEST(ZipCacheCache, DecodeAccumulationAsTheOriginal) {
  auto cache = KVCacheFactory::create(zip_config(0));
  Io prefill(1, 2, 32, 128, 7);
  cache->update_and_fetch(prefill.kb, prefill.vb);
  CacheView v;
  for (int i = 0; i < 3; ++i) {
    Io tok(1, 2, 1, 128, 100 + i);
    v = cache->update_and_fetch(tok.kb, tok.vb);
    // A decode token is its own 1-row hi group: reconstructed exactly.
    EXPECT_EQ(std::vector<std::uint16_t>(v.key_row(0, 1, 32 + i), v.key_row(0, 1, 32 + i) + 128),
              std::vector<std::uint16_t>(tok.k.begin() + 128, tok.k.end()));
  }
  EXPECT_EQ(v.tokens, 35u);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("accounted_key_bytes"), 2 * 4035.0);
  EXPECT_NEAR(st.figure("compression_ratio_keys"), 8960.0 / 4035.0, 1e-12);  // 2.22
}

TEST(ZipCacheCache, StagingKeepsLongGenerationsCompressed) {
  // The documented per-call compression charges 577 B per decode head-token (ratio < 1 over a long
  // generation) and, stored for real, costs more than fp16; the staging window does not.
  double ratio[2], keys_ratio[2];
  for (int staging : {0, 128}) {
    auto cache = KVCacheFactory::create(zip_config(staging));
    Io prefill(1, 2, 64, 128, 8);
    cache->update_and_fetch(prefill.kb, prefill.vb);
    for (int i = 0; i < 600; ++i) {
      Io tok(1, 2, 1, 128, 200 + i);
      cache->update_and_fetch(tok.kb, tok.vb);
    }
    const CacheStats st = cache->stats();
    EXPECT_EQ(st.tokens_kept, 664u);
    ratio[staging != 0] = st.compression_ratio;
    keys_ratio[staging != 0] = st.figure("compression_ratio_keys");
  }
  EXPECT_LT(keys_ratio[0], 1.0);  // the original's figure decays below 1
  EXPECT_LT(ratio[0], 1.0);       // stored for real: more than fp16
  EXPECT_GT(ratio[1], 2.0);       // staging: compressed (the fp16 window included)
  EXPECT_GT(ratio[1], 2.5 * ratio[0]);
}

TEST(ZipCacheCache, StagedTokensAreExactAndCountedWhileWaiting) {
  auto cache = KVCacheFactory::create(zip_config(128));
  Io io(1, 1, 40, 64, 9);
  const CacheView v = cache->update_and_fetch(io.kb, io.vb);
  EXPECT_EQ(std::vector<std::uint16_t>(v.keys, v.keys + io.k.size()), io.k);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("staging_tokens"), 40.0);
  EXPECT_GE(st.resident_bytes, 2u * 40 * 64 * 2);
  // Reaching the window compresses complete groups; the remainder keeps waiting.
  Io more(1, 1, 100, 64, 10);
  cache->update_and_fetch(more.kb, more.vb);
  EXPECT_EQ(cache->stats().figure("staging_tokens"), 140.0 - 128.0);
  EXPECT_EQ(cache->stats().figure("compressed_blocks"), 1.0);
}

TEST(ZipCacheCache, PositionsAreTrueAndPerRow) {
  auto cache = KVCacheFactory::create(zip_config(32));
  Io io(1, 2, 40, 16, 11);
  std::vector<std::int64_t> pos(40);
  for (int i = 0; i < 40; ++i) pos[i] = 100 + 2 * i;
  cache->update_and_fetch(io.kb, io.vb, pos);
  Io tok(1, 2, 1, 16, 12);
  const CacheView v = cache->update_and_fetch(tok.kb, tok.vb);
  ASSERT_EQ(v.tokens, 41u);
  for (std::size_t h = 0; h < 2; ++h) {
    for (std::size_t i = 0; i < 40; ++i) EXPECT_EQ(v.position(0, h, i), 100 + 2 * std::int64_t(i));
    EXPECT_EQ(v.position(0, h, 40), 179);
  }
}

TEST(ZipCacheCache, Deterministic) {
  KVCacheConfig c = zip_config(32);
  auto a = KVCacheFactory::create(c), b = KVCacheFactory::create(c);
  Io io(1, 2, 100, 64, 13);
  const CacheView va = a->update_and_fetch(io.kb, io.vb);
  const std::vector<std::uint16_t> ka(va.keys, va.keys + io.k.size());
  const CacheView vb = b->update_and_fetch(io.kb, io.vb);
  EXPECT_EQ(ka, std::vector<std::uint16_t>(vb.keys, vb.keys + io.k.size()));
}

TEST(ZipCacheCache, ForModelPropagatesConfigAndSharesOneScratch) {
  KVCacheConfig c = zip_config(32);
  c.zipcache_hi_fraction = 0.25;
  CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 64), c);
  ASSERT_EQ(set.size(), 2u);
  Io io0(1, 2, 64, 64, 14), io1(1, 2, 64, 64, 15);
  const CacheView v0 = set.at(0).update_and_fetch(io0.kb, io0.vb);
  const std::vector<std::uint16_t> k0(v0.keys, v0.keys + io0.k.size());
  set.at(1).update_and_fetch(io1.kb, io1.vb);  // overwrites the shared scratch
  for (std::size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(set.at(l).method(), "zipcache");
    EXPECT_EQ(set.at(l).stats().figure("hi_fraction"), 0.25);
    EXPECT_EQ(dynamic_cast<const ZipCacheCache&>(set.at(l)).heads()[0].blocks[0].keys.n_hi, 16u);  // ceil(64*.25)
  }
  const CacheView again = set.at(0).view();  // re-decoded from layer 0's compressed state
  EXPECT_EQ(k0, std::vector<std::uint16_t>(again.keys, again.keys + io0.k.size()));
}

TEST(ZipCacheCache, BadFractionRejectedAtConstruction) {
  for (double hf : {1.5, -0.2}) {
    KVCacheConfig c = zip_config();
    c.zipcache_hi_fraction = hf;
    try {
      KVCacheFactory::create(c);
      FAIL() << hf;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("zipcache_hi_fraction"), std::string::npos) << e.what();
    }
  }
}

TEST(ZipCacheCache, NonFiniteInputNamesTensorAndIndexAndChangesNothing) {
  auto cache = KVCacheFactory::create(zip_config(32));
  Io io(2, 2, 8, 16, 16);
  cache->update_and_fetch(io.kb, io.vb);
  Io bad(2, 2, 3, 16, 17);
  bad.v[((1 * 2 + 1) * 3 + 2) * 16 + 5] = 0x7e00;  // NaN in values[1, 1, 2]
  try {
    cache->update_and_fetch(bad.kb, bad.vb);
    FAIL();
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("values"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[1, 1, 2"), std::string::npos) << msg;
  }
  bad.v[((1 * 2 + 1) * 3 + 2) * 16 + 5] = 0;
  bad.k[3] = 0x7c00;  // +inf in keys[0, 0, 0]
  EXPECT_THROW(cache->update_and_fetch(bad.kb, bad.vb), InputError);
  EXPECT_EQ(cache->stats().tokens_seen, 8u);
  EXPECT_EQ(cache->view().tokens, 8u);
}

TEST(ZipCacheCache, FloatInputBeyondFp16Rejected) {
  auto cache = KVCacheFactory::create(zip_config(0));
  std::vector<float> k(4 * 8, 1.0f), v(4 * 8, 1.0f);
  k[9] = 1e6f;
  EXPECT_THROW(cache->update_and_fetch(make_block(k.data(), 1, 1, 4, 8), make_block(v.data(), 1, 1, 4, 8)), InputError);
}

TEST(ZipCacheCache, ShapeChecks) {
  auto cache = KVCacheFactory::create(zip_config(0));
  Io io(1, 2, 4, 16, 18), other(1, 3, 4, 16, 19), empty(1, 2, 0, 16, 20);
  cache->update_and_fetch(io.kb, io.vb);
  EXPECT_THROW(cache->update_and_fetch(other.kb, other.vb), InputError);  // heads changed
  EXPECT_THROW(cache->update_and_fetch(io.kb, other.vb), InputError);     // keys/values differ
  EXPECT_THROW(cache->update_and_fetch(empty.kb, empty.vb), InputError);  // no tokens
  cache->reset();
  EXPECT_EQ(cache->stats().tokens_kept, 0u);
  EXPECT_EQ(cache->update_and_fetch(other.kb, other.vb).heads, 3u);
}

TEST(ZipCacheCache, AttentionSaliencyPicksTheAttendedTokens) {
  KVCacheConfig c = zip_config(32);
  c.zipcache_saliency = "attention_normalized";
  c.zipcache_hi_fraction = 0.125;  // 4 of 32
  auto cache = KVCacheFactory::create(c);
  EXPECT_TRUE(cache->needs().attention);
  Io io(1, 1, 32, 16, 21);
  const CacheView v = cache->update_and_fetch(io.kb, io.vb);
  EXPECT_EQ(cache->stats().figure("staging_tokens"), 32.0);  // waits for its attention
  // 32 causal queries; tokens 3, 9, 17, 30 get most of the attention of every query that sees them.
  std::vector<float> probs(32 * 32, 0.0f);
  std::vector<std::int64_t> qpos(32);
  const std::size_t favoured[] = {3, 9, 17, 30};
  for (std::size_t q = 0; q < 32; ++q) {
    qpos[q] = std::int64_t(q);
    for (std::size_t i = 0; i <= q; ++i) probs[q * 32 + i] = 0.01f;
    for (std::size_t f : favoured)
      if (f <= q) probs[q * 32 + f] = 0.5f;
  }
  AttentionObservation obs{probs.data(), 1, 1, 32, v.tokens, 32, qpos};
  cache->observe_attention(obs);
  // Compressed as soon as its attention is known, not held in fp16 until the next update
  // (regression: the prompt stayed staged, and a model held 1.03x the full cache's bytes).
  EXPECT_EQ(cache->stats().figure("staging_tokens"), 0.0);
  EXPECT_LT(cache->stats().resident_bytes, cache->stats().seen_fp16_bytes);
  Io tok(1, 1, 1, 16, 22);
  cache->update_and_fetch(tok.kb, tok.vb);
  const auto& zc = dynamic_cast<const ZipCacheCache&>(*cache);
  ASSERT_EQ(zc.heads()[0].blocks.size(), 1u);
  const auto mask = zc.heads()[0].blocks[0].keys.mask();
  for (std::size_t i = 0; i < 32; ++i) {
    const bool expected = i == 3 || i == 9 || i == 17 || i == 30;
    EXPECT_EQ(mask[i], expected ? 1 : 0) << i;
  }
  AttentionObservation wrong{probs.data(), 1, 2, 32, 33, 33, qpos};
  EXPECT_THROW(cache->observe_attention(wrong), InputError);
}

TEST(ZipCacheCache, BadSaliencyNameRejected) {
  KVCacheConfig c = zip_config();
  c.zipcache_saliency = "norm";
  EXPECT_THROW(KVCacheFactory::create(c), ConfigError);
}

TEST(KiviCache, UniformGroupQuantizationOfKeysAndValues) {
  KVCacheConfig c;
  c.method = "kivi";
  c.kivi_bits = 4;
  c.kivi_group_size = 32;
  c.kivi_staging = 32;
  auto cache = KVCacheFactory::create(c);
  Io io(1, 2, 64, 128, 23);
  const CacheView v = cache->update_and_fetch(io.kb, io.vb);
  EXPECT_GT(cosine_fp16(v.keys, io.k.data(), io.k.size()), 0.995);
  EXPECT_GT(cosine_fp16(v.values, io.v.data(), io.v.size()), 0.995);
  const auto& zc = dynamic_cast<const ZipCacheCache&>(*cache);
  const auto& block = zc.heads()[0].blocks[0];
  EXPECT_EQ(block.keys.n_hi, 0u);
  EXPECT_TRUE(block.keys.mask_bits.empty());
  EXPECT_EQ(block.keys.lo.bits, 4);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.figure("accounted_key_bytes"), 2.0 * base_only_bytes(64, 128, 4, 32));
  // 4-bit codes + fp16 params per 32 rows: 4 + 1 bits per element, keys and values.
  EXPECT_EQ(st.figure("resident_key_bytes"), 2.0 * (64 * 64 + 2 * 128 * 4));
  c.kivi_bits = 2;
  auto two = KVCacheFactory::create(c);
  const CacheView v2 = two->update_and_fetch(io.kb, io.vb);
  const double cos2 = cosine_fp16(v2.keys, io.k.data(), io.k.size());
  EXPECT_GT(cos2, 0.8);
  EXPECT_LT(cos2, 0.99);
}

TEST(ZipCacheCache, AcceptsBf16AndF32Input) {
  for (DType t : {DType::bf16, DType::f32}) {
    auto cache = KVCacheFactory::create(zip_config(0));
    std::vector<float> f(2 * 40 * 32);
    std::mt19937 rng(24);
    std::normal_distribution<float> dist(0, 1);
    for (auto& x : f) x = dist(rng);
    std::vector<std::uint16_t> b(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
    KVBlock k{t == DType::f32 ? static_cast<const void*>(f.data()) : b.data(), t, 1, 2, 40, 32};
    const CacheView v = cache->update_and_fetch(k, k);
    EXPECT_EQ(v.tokens, 40u);
    std::vector<std::uint16_t> ref(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) ref[i] = f32_to_fp16(f[i]);
    EXPECT_GT(cosine_fp16(v.values, ref.data(), ref.size()), 0.99);
  }
}

}  // namespace
}  // namespace kvslim
