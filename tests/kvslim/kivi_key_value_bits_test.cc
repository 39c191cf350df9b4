// kivi with keys and values at their own widths (KVCacheConfig::kivi_key_bits / kivi_value_bits,
// issue 27): the fields default to kivi_bits, each tensor is packed at its own width and stays
// within its width's round-trip bound, the keys are exactly the uniform cache's at the key width
// and the values exactly the uniform cache's at the value width, attention over mixed widths is
// attention over the dequantized rows, and the same holds for the kivi storage under a policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/zipcache_cache.h"
#include "kvslim/errors.h"
#include "kvslim/kvslim.h"
#include "kvslim/zipcache.h"
#include "storage/packed_rows.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::normal_fp16;

KVCacheConfig kivi(int key_bits, int value_bits, int group = 32, int staging = 0) {
  KVCacheConfig c;
  c.method = "kivi";
  c.kivi_key_bits = key_bits;
  c.kivi_value_bits = value_bits;
  c.kivi_group_size = group;
  c.kivi_staging = staging;
  return c;
}

const std::vector<std::pair<int, int>> kWidths = {{2, 3}, {2, 4}, {3, 2}, {4, 2}, {1, 8}, {8, 1}, {2, 2}};

// max over the elements of |x - decoded| / bound, the bound of the asymmetric min/max grid for the
// element's (head, group of rows, channel): half a step, (max - min) / (2^bits - 1) / 2, plus the
// fp16 roundings of the zero point, the step and the decoded value. [H, S, D] original rows,
// decoded rows at head_stride rows per head.
double worst_over_bound(const std::vector<float>& x, const std::uint16_t* decoded, std::size_t head_stride,
                        std::size_t H, std::size_t S, std::size_t D, std::size_t group, int bits) {
  const double levels = std::ldexp(1.0, bits) - 1.0;
  double worst = 0;
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t r0 = 0; r0 < S; r0 += group) {
      const std::size_t r1 = std::min(S, r0 + group);
      for (std::size_t d = 0; d < D; ++d) {
        double mn = 1e30, mx = -1e30;
        for (std::size_t r = r0; r < r1; ++r) {
          mn = std::min<double>(mn, x[(h * S + r) * D + d]);
          mx = std::max<double>(mx, x[(h * S + r) * D + d]);
        }
        const double bound = 0.5 * (mx - mn) / levels * 1.002 + 1e-3 * (std::fabs(mn) + std::fabs(mx)) + 1e-6;
        for (std::size_t r = r0; r < r1; ++r) {
          const double e = std::fabs(x[(h * S + r) * D + d] - fp16_to_f32(decoded[(h * head_stride + r) * D + d]));
          worst = std::max(worst, e / bound);
        }
      }
    }
  }
  return worst;
}

// validate() refuses `c`, naming every fragment; `what` says which config it was.
void expect_refused(const KVCacheConfig& c, std::initializer_list<const char*> fragments, const std::string& what) {
  try {
    c.validate();
    ADD_FAILURE() << what << " accepted";
  } catch (const ConfigError& e) {
    for (const char* f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(KiviKeyValueBits, FieldsDefaultToKiviBitsAndAreValidatedByName) {
  KVCacheConfig c;
  EXPECT_EQ(c.kivi_key_bits, -1);
  EXPECT_EQ(c.kivi_value_bits, -1);
  // The default (kivi_bits -1): keys at 4 bits, values at 2, groups of 128 rows (issue 27).
  EXPECT_EQ(c.kivi_bits, -1);
  EXPECT_EQ(c.kivi_keys_at(), 4);
  EXPECT_EQ(c.kivi_values_at(), 2);
  EXPECT_EQ(c.kivi_group_size, 128);
  EXPECT_NO_THROW(c.validate());
  for (const char* bad : {"0", "-2", "9"}) {
    KVCacheConfig b;
    b.set("kivi_bits", bad);
    expect_refused(b, {"kivi_bits"}, std::string("kivi_bits = ") + bad);
  }
  c.kivi_bits = 3;
  EXPECT_EQ(c.kivi_keys_at(), 3);
  EXPECT_EQ(c.kivi_values_at(), 3);
  c.set("kivi_key_bits", "2");
  c.set("kivi_value_bits", "4");
  EXPECT_EQ(c.kivi_keys_at(), 2);
  EXPECT_EQ(c.kivi_values_at(), 4);
  EXPECT_NO_THROW(c.validate());
  bool key_listed = false, value_listed = false;
  for (const auto& [name, value] : c.fields()) {
    key_listed = key_listed || (name == "kivi_key_bits" && value == "2");
    value_listed = value_listed || (name == "kivi_value_bits" && value == "4");
  }
  EXPECT_TRUE(key_listed && value_listed);
  for (const char* field : {"kivi_key_bits", "kivi_value_bits"}) {
    for (const char* bad : {"0", "9", "-2"}) {
      KVCacheConfig b;
      b.set(field, bad);
      expect_refused(b, {field, "kivi_bits"}, std::string(field) + " = " + bad);  // (kivi_bits: what -1 means)
    }
    KVCacheConfig b;
    EXPECT_THROW(b.set(field, "2.5"), ConfigError);
  }
}

// A CUDA device's kivi storage reads 2-, 4- or 8-bit codes, keys and values each at its own width,
// groups of whole 32-row units behind a window: validate() (before any device code runs) takes every
// such config and refuses any other, naming the field; the CPU takes them all.
TEST(KiviKeyValueBits, ACudaDeviceTakesTwoFourOrEightBitsEachAndWholeUnitGroups) {
  KVCacheConfig c;
  c.method = "kivi";
  c.device = "cuda";
  for (int kb : {-1, 2, 4, 8}) {
    for (int vb : {-1, 2, 4, 8}) {
      c.kivi_key_bits = kb;
      c.kivi_value_bits = vb;
      EXPECT_NO_THROW(c.validate()) << kb << "/" << vb;
    }
  }
  for (const auto& [bits, kb, vb, field] :
       {std::tuple{2, 3, -1, "kivi_key_bits"}, std::tuple{2, -1, 1, "kivi_value_bits"}, std::tuple{3, -1, 2, "kivi_bits"},
        std::tuple{2, 4, 3, "kivi_value_bits"}}) {
    c.kivi_bits = bits;
    c.kivi_key_bits = kb;
    c.kivi_value_bits = vb;
    expect_refused(c, {field, "CUDA"}, std::to_string(bits) + " " + std::to_string(kb) + "/" + std::to_string(vb) + " on cuda");
    EXPECT_THROW(KVCacheFactory::create(c), ConfigError);
    c.device = "cpu";
    EXPECT_NO_THROW(c.validate()) << kb << "/" << vb;  // the CPU caches take any pair
    c.device = "cuda";
  }
  c.kivi_bits = 2;
  c.kivi_key_bits = 4;
  c.kivi_value_bits = 2;
  for (int group : {32, 64, 128, 256, 1024}) {
    c.kivi_group_size = group;
    c.kivi_staging = std::max(128, group);
    EXPECT_NO_THROW(c.validate()) << group;
  }
  for (const auto& [group, staging, field] : {std::tuple{48, 96, "kivi_group_size"}, std::tuple{2048, 2048, "kivi_group_size"},
                                              std::tuple{16, 128, "kivi_group_size"}, std::tuple{32, 0, "kivi_staging"}}) {
    c.kivi_group_size = group;
    c.kivi_staging = staging;
    expect_refused(c, {field, "CUDA"}, "group " + std::to_string(group) + " staging " + std::to_string(staging) + " on cuda");
    c.device = "cpu";
    EXPECT_NO_THROW(c.validate()) << group << " " << staging;
    c.device = "cuda";
  }
}

// Each tensor packed at its own width: codes of packed_row_bytes(D, bits) per row, fp16 scale and
// zero per group and channel, nothing else; every element within its width's bound; the bytes
// and figures follow the two widths.
TEST(KiviKeyValueBits, EachTensorIsPackedAtItsWidthWithinItsRoundTripBound) {
  constexpr std::size_t H = 2, S = 96, D = 64, G = 32;
  for (const auto& [kb, vb] : kWidths) {
    SCOPED_TRACE("K" + std::to_string(kb) + "V" + std::to_string(vb));
    auto cache = KVCacheFactory::create(kivi(kb, vb, static_cast<int>(G), 0));
    KV io(1, H, S, D, 41);
    const CacheView v = cache->update_and_fetch(io.keys(), io.values());
    ASSERT_EQ(v.tokens, S);
    const auto& zc = dynamic_cast<const ZipCacheCache&>(*cache);
    ASSERT_EQ(zc.options().hi_bits, kb);
    ASSERT_EQ(zc.options().values_at(), vb);
    for (const auto& head : zc.heads()) {
      ASSERT_EQ(head.blocks.size(), 1u);
      const auto& b = head.blocks[0];
      EXPECT_EQ(b.keys.n_hi, 0u);  // one precision: every key row in one set
      EXPECT_EQ(b.keys.lo.bits, kb);
      EXPECT_EQ(b.keys.lo.codes.size(), S * packed_row_bytes(D, kb));
      EXPECT_EQ(b.keys.lo.scale.size(), S / G * D);
      EXPECT_EQ(b.values.bits, vb);
      EXPECT_EQ(b.values.codes.size(), S * packed_row_bytes(D, vb));
      EXPECT_EQ(b.values.scale.size(), S / G * D);
      EXPECT_EQ(b.values.zero.size(), S / G * D);
    }
    EXPECT_LE(worst_over_bound(io.k, v.keys, v.head_stride, H, S, D, G, kb), 1.0);
    EXPECT_LE(worst_over_bound(io.v, v.values, v.head_stride, H, S, D, G, vb), 1.0);
    const CacheStats st = cache->stats();
    EXPECT_EQ(st.figure("resident_key_bytes"), H * (S * packed_row_bytes(D, kb) + S / G * D * 4.0));
    EXPECT_EQ(st.figure("resident_value_bytes"), H * (S * packed_row_bytes(D, vb) + S / G * D * 4.0));
    EXPECT_EQ(st.figure("accounted_key_bytes"), H * static_cast<double>(base_only_bytes(S, D, kb, G)));
    EXPECT_EQ(st.figure("accounted_value_bytes"), H * static_cast<double>(base_only_bytes(S, D, vb, G)));
    EXPECT_EQ(st.figure("hi_bits"), kb);
    EXPECT_EQ(st.figure("value_bits"), vb);
  }
  // The bound is tight: at 1 bit the keys' error reaches most of half a step (the widths are real).
  auto one = KVCacheFactory::create(kivi(1, 8, static_cast<int>(G), 0));
  KV io(1, H, S, D, 41);
  const CacheView v = one->update_and_fetch(io.keys(), io.values());
  EXPECT_GT(worst_over_bound(io.k, v.keys, v.head_stride, H, S, D, G, 1), 0.8);
  EXPECT_LT(worst_over_bound(io.v, v.values, v.head_stride, H, S, D, G, 1), 0.02);  // 8-bit values: far inside 1 bit's
}

// The keys of a K{k}V{v} cache are bit for bit the uniform kivi_bits = k cache's keys, its values
// the uniform kivi_bits = v cache's values: through a prompt, the staging window and decode rows
// compressed a window at a time.
TEST(KiviKeyValueBits, KeysAreTheUniformCachesAtTheKeyWidthAndValuesAtTheValueWidth) {
  constexpr std::size_t H = 3, D = 64;
  for (const auto& [kb, vb] : kWidths) {
    SCOPED_TRACE("K" + std::to_string(kb) + "V" + std::to_string(vb));
    auto mixed = KVCacheFactory::create(kivi(kb, vb, 32, 64));
    KVCacheConfig ck = kivi(-1, -1, 32, 64), cv = ck;
    ck.kivi_bits = kb;
    cv.kivi_bits = vb;
    auto keys_ref = KVCacheFactory::create(ck);
    auto values_ref = KVCacheFactory::create(cv);
    std::size_t pos = 0;
    for (std::size_t step = 0; step < 40; ++step) {
      const std::size_t S = step == 0 ? 100 : 1;
      KV io(1, H, S, D, 77 + static_cast<unsigned>(step));
      std::vector<std::int64_t> p(S);
      for (std::size_t i = 0; i < S; ++i) p[i] = static_cast<std::int64_t>(pos + i);
      pos += S;
      for (KVCache* c : {mixed.get(), keys_ref.get(), values_ref.get()}) c->append(io.keys(), io.values(), p);
    }
    const CacheView m = mixed->materialize();
    const CacheView k = keys_ref->materialize();
    ASSERT_EQ(m.tokens, 139u);
    ASSERT_EQ(0, std::memcmp(m.keys, k.keys, H * m.tokens * D * 2));
    const CacheView v = values_ref->materialize();  // (each cache's own scratch: m stays valid)
    ASSERT_EQ(0, std::memcmp(m.values, v.values, H * m.tokens * D * 2));
    EXPECT_EQ(mixed->stats().figure("staging_tokens"), 43.0);  // 96 of the prompt packed, 4 + 39 waiting
  }
}

// out[q] = sum_r softmax_r(q . k_r / sqrt(D)) v_r over the rows a query may see, in double, from
// the cache's own dequantized rows (materialize), [Hq, D] for one query at position qpos.
std::vector<double> reference_attention(const CacheView& v, const std::vector<float>& q, std::size_t Hq,
                                        std::int64_t qpos) {
  const std::size_t D = v.head_dim, group = Hq / v.heads;
  std::vector<double> out(Hq * D, 0.0);
  for (std::size_t hq = 0; hq < Hq; ++hq) {
    const std::size_t h = hq / group;
    std::vector<double> logit(v.tokens, -1e300);
    double top = -1e300;
    for (std::size_t i = 0; i < v.tokens; ++i) {
      if (v.positions[h * v.head_stride + i] > qpos) continue;
      double s = 0;
      for (std::size_t d = 0; d < D; ++d) s += q[hq * D + d] * fp16_to_f32(v.keys[(h * v.head_stride + i) * D + d]);
      logit[i] = s / std::sqrt(static_cast<double>(D));
      top = std::max(top, logit[i]);
    }
    double sum = 0;
    for (std::size_t i = 0; i < v.tokens; ++i) {
      if (logit[i] <= -1e299) continue;
      const double w = std::exp(logit[i] - top);
      sum += w;
      for (std::size_t d = 0; d < D; ++d) out[hq * D + d] += w * fp16_to_f32(v.values[(h * v.head_stride + i) * D + d]);
    }
    for (std::size_t d = 0; d < D; ++d) out[hq * D + d] /= sum;
  }
  return out;
}

void expect_attention_is_over_the_dequantized_rows(KVCache& cache, std::size_t H, std::size_t D, std::int64_t qpos,
                                                   unsigned seed) {
  const std::size_t Hq = 2 * H;  // a KV group of two query heads
  const std::vector<float> q = normal_fp16(Hq * D, seed);
  std::vector<float> out(Hq * D);
  const std::vector<std::int64_t> p{qpos};
  cache.attend(QueryBlock{q.data(), 1, 1, Hq, D}, p, out.data());
  const std::vector<double> ref = reference_attention(cache.materialize(), q, Hq, qpos);
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 4e-3 * (1 + std::fabs(ref[i]))) << i;  // attend_test's tolerance
}

// attend reads each tensor's codes at its own width (the integer kernels for 2/4/8 bits, the fp32
// ones for the others, keys and values independently): the result is attention over the rows the
// codes decode to, compressed blocks and the fp16 window together, a query in the middle included.
TEST(KiviKeyValueBits, AttentionOverMixedWidthsIsAttentionOverTheDequantizedRows) {
  constexpr std::size_t H = 2, D = 64;
  for (const auto& [kb, vb] : kWidths) {
    SCOPED_TRACE("K" + std::to_string(kb) + "V" + std::to_string(vb));
    auto cache = KVCacheFactory::create(kivi(kb, vb, 32, 32));
    KV prompt(1, H, 150, D, 5);
    std::vector<std::int64_t> p(150);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<std::int64_t>(i);
    cache->append(prompt.keys(), prompt.values(), p);
    for (std::size_t t = 0; t < 20; ++t) {
      KV step(1, H, 1, D, 300 + static_cast<unsigned>(t));
      cache->append(step.keys(), step.values(), std::vector<std::int64_t>{static_cast<std::int64_t>(150 + t)});
    }
    ASSERT_GT(dynamic_cast<const ZipCacheCache&>(*cache).staged_tokens(), 0u);
    expect_attention_is_over_the_dequantized_rows(*cache, H, D, 169, 9);
    expect_attention_is_over_the_dequantized_rows(*cache, H, D, 100, 10);
  }
}

// The kivi storage under a policy (storage = kivi, h2o): rows packed at the two widths, attention
// over them is attention over their dequantized rows, and a kept row costs what its widths say:
// K2V3 between kivi2 and kivi3, K2V4 the same as kivi3 (2 + 4 = 3 + 3 bits per row pair).
TEST(KiviKeyValueBits, TheKiviStorageUnderAPolicyHoldsEachTensorAtItsWidth) {
  constexpr std::size_t H = 3, D = 64, prompt = 300;
  auto composed = [](int kb, int vb) {
    KVCacheConfig c;
    c.method = "h2o";
    c.storage = "kivi";
    c.kivi_bits = kb;
    c.kivi_key_bits = kb;
    c.kivi_value_bits = vb;
    c.kivi_group_size = 64;
    c.kivi_staging = 16;
    c.h2o_budget = 160;
    return c;
  };
  auto run = [&](const KVCacheConfig& c) {
    auto cache = KVCacheFactory::create(c);
    KV io(1, H, prompt, D, 5);
    std::vector<std::int64_t> p(prompt);
    for (std::size_t i = 0; i < prompt; ++i) p[i] = static_cast<std::int64_t>(i);
    cache->append(io.keys(), io.values(), p);
    // A flat attention observation: every row of every head equally attended by the last query.
    const std::size_t N = cache->rows();
    std::vector<float> probs(H * N, 1.0f / static_cast<float>(N));
    const std::vector<std::int64_t> qp{static_cast<std::int64_t>(prompt - 1)};
    cache->observe_attention(AttentionObservation{probs.data(), 1, H, 1, N, N, qp});
    return cache;
  };
  auto k2v3 = run(composed(2, 3)), k2v4 = run(composed(2, 4)), k2 = run(composed(2, 2)), k3 = run(composed(3, 3));
  ASSERT_EQ(k2v3->rows(), 160u);
  for (KVCache* c : {k2v3.get(), k2v4.get()}) {
    EXPECT_EQ(c->stats().figure("storage_staged_rows"), 0.0);  // the prompt's survivors are all packed
    EXPECT_EQ(c->stats().figure("hi_bits"), 2.0);
    expect_attention_is_over_the_dequantized_rows(*c, H, D, 400, 12);
  }
  EXPECT_EQ(k2v3->stats().figure("value_bits"), 3.0);
  EXPECT_EQ(k2v4->stats().figure("value_bits"), 4.0);
  const auto bytes = [](const KVCache& c) { return c.stats().resident_bytes; };
  EXPECT_LT(bytes(*k2), bytes(*k2v3));
  EXPECT_LT(bytes(*k2v3), bytes(*k3));
  EXPECT_EQ(bytes(*k2v4), bytes(*k3));
  // The packed layout of one head: every block's keys at 2 bits, values at 3.
  // (Through the storage's row form: materialize equals a K2V3 kivi cache given the same rows in order.)
  KVCacheConfig only = composed(2, 3);
  only.method = "kivi";
  only.storage = "fp16";
  only.kivi_staging = 0;
  const CacheView mv = k2v3->materialize();
  std::vector<float> keys(H * mv.tokens * D), values(H * mv.tokens * D);
  std::vector<std::vector<std::pair<std::int64_t, std::size_t>>> order(H);
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t i = 0; i < mv.tokens; ++i) order[h].emplace_back(mv.positions[h * mv.head_stride + i], i);
    std::sort(order[h].begin(), order[h].end());
  }
  // The prompt's original rows of the kept positions, in position order per head.
  KV io(1, H, prompt, D, 5);
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t j = 0; j < mv.tokens; ++j) {
      const std::size_t src = static_cast<std::size_t>(order[h][j].first);
      for (std::size_t d = 0; d < D; ++d) {
        keys[(h * mv.tokens + j) * D + d] = io.k[(h * prompt + src) * D + d];
        values[(h * mv.tokens + j) * D + d] = io.v[(h * prompt + src) * D + d];
      }
    }
  }
  auto ref = KVCacheFactory::create(only);
  std::vector<std::int64_t> rp(mv.tokens);
  for (std::size_t i = 0; i < rp.size(); ++i) rp[i] = static_cast<std::int64_t>(i);
  ref->append(make_block(keys.data(), 1, H, mv.tokens, D), make_block(values.data(), 1, H, mv.tokens, D), rp);
  const CacheView rv = ref->materialize();
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t j = 0; j < mv.tokens; ++j) {
      const std::size_t i = order[h][j].second;
      ASSERT_EQ(0, std::memcmp(mv.keys + (h * mv.head_stride + i) * D, rv.keys + (h * rv.head_stride + j) * D, D * 2)) << h << " " << j;
      ASSERT_EQ(0, std::memcmp(mv.values + (h * mv.head_stride + i) * D, rv.values + (h * rv.head_stride + j) * D, D * 2)) << h << " " << j;
    }
  }
}


// zipcache's values at their own width (zipcache_value_bits, -1 = zipcache_hi_bits): keys keep
// their two widths by saliency, values are exactly the kivi cache's at that width, attention is
// over the dequantized rows, and the zipcache storage under a policy holds them so too.
TEST(ZipcacheValueBits, ValuesAtTheirOwnWidthBesideMixedPrecisionKeys) {
  KVCacheConfig bad;
  for (const char* v : {"0", "9", "-3"}) {
    bad.set("zipcache_value_bits", v);
    expect_refused(bad, {"zipcache_value_bits"}, std::string("zipcache_value_bits = ") + v);
  }
  constexpr std::size_t H = 2, S = 128, D = 64;
  KVCacheConfig z;
  z.method = "zipcache";
  z.zipcache_hi_bits = 3;
  z.zipcache_lo_bits = 2;
  z.zipcache_hi_fraction = 0.5;
  z.zipcache_value_bits = 1;
  z.zipcache_group_size = 64;
  z.zipcache_staging = 64;
  auto zip = KVCacheFactory::create(z);
  KVCacheConfig k = kivi(-1, -1, 64, 64);
  k.kivi_bits = 1;
  auto ref = KVCacheFactory::create(k);
  KV io(1, H, S, D, 19);
  std::vector<std::int64_t> p(S);
  for (std::size_t i = 0; i < S; ++i) p[i] = static_cast<std::int64_t>(i);
  zip->append(io.keys(), io.values(), p);
  ref->append(io.keys(), io.values(), p);
  const auto& zc = dynamic_cast<const ZipCacheCache&>(*zip);
  for (const auto& head : zc.heads()) {
    ASSERT_EQ(head.blocks.size(), 1u);
    EXPECT_EQ(head.blocks[0].keys.hi.bits, 3);
    EXPECT_EQ(head.blocks[0].keys.lo.bits, 2);
    EXPECT_EQ(head.blocks[0].keys.n_hi, S / 2);
    EXPECT_EQ(head.blocks[0].values.bits, 1);
    EXPECT_EQ(head.blocks[0].values.codes.size(), S * packed_row_bytes(D, 1));
  }
  EXPECT_EQ(zip->stats().figure("value_bits"), 1.0);
  EXPECT_EQ(zip->stats().figure("accounted_value_bytes"), H * static_cast<double>(zipcache_accounted_bytes(S, 0, S, D, 1, 1, 64)));
  const CacheView zv = zip->materialize();
  const CacheView rv = ref->materialize();
  ASSERT_EQ(0, std::memcmp(zv.values, rv.values, H * S * D * 2));
  expect_attention_is_over_the_dequantized_rows(*zip, H, D, 127, 21);
  expect_attention_is_over_the_dequantized_rows(*zip, H, D, 50, 22);

  // The zipcache storage under h2o: values packed at 1 bit, attention over the dequantized rows.
  KVCacheConfig c = z;
  c.method = "h2o";
  c.storage = "zipcache";
  c.zipcache_staging = 16;
  c.h2o_budget = 100;
  auto composed = KVCacheFactory::create(c);
  composed->append(io.keys(), io.values(), p);
  const std::size_t N = composed->rows();
  std::vector<float> probs(H * N, 1.0f / static_cast<float>(N));
  const std::vector<std::int64_t> qp{static_cast<std::int64_t>(S - 1)};
  composed->observe_attention(AttentionObservation{probs.data(), 1, H, 1, N, N, qp});
  ASSERT_EQ(composed->rows(), 100u);
  EXPECT_EQ(composed->stats().figure("value_bits"), 1.0);
  EXPECT_EQ(composed->stats().figure("storage_staged_rows"), 0.0);
  expect_attention_is_over_the_dequantized_rows(*composed, H, D, 200, 23);
}

}  // namespace
}  // namespace kvslim
