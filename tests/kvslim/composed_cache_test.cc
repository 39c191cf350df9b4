// A cache is a policy over a storage: every eviction policy over every row storage
// (KVCacheConfig::storage). The policy must keep exactly the rows it keeps over fp16 slots, the
// storage must hold them exactly as the storage-only cache would, attention over the composed cache
// must equal attention over those rows, and the bytes must fall as both predict.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvslim/convert.h"
#include "kvslim/errors.h"
#include "kvslim/squeeze.h"
#include "quant/group_quant.h"
#include "cache/eviction_cache.h"
#include "storage/packed_rows.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::normal_fp16;

// A deterministic attention weight of (head, query position, row position), > 0.
float weight(std::size_t head, std::int64_t q, std::int64_t p) {
  std::uint64_t x = head * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(q) * 0xC2B2AE3D27D4EB4Full ^
                    static_cast<std::uint64_t>(p) * 0x165667B19E3779F9ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return 0.05f + static_cast<float>(x % 1000) / 1000.0f;
}

// The same attention by position for any cache, whatever its row order: each query's weights over
// the rows it may see, normalised (a KV group of two query heads: summed to 2).
void observe(KVCache& cache, const std::vector<std::int64_t>& qpos) {
  if (!cache.needs().attention) return;
  const CacheView v = cache.materialize();
  const std::size_t H = v.batch * v.heads, Q = qpos.size(), N = v.tokens;
  std::vector<float> probs(H * Q * N, 0.0f);  // [B, H, Q, rows]
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t q = 0; q < Q; ++q) {
      float* row = probs.data() + (h * Q + q) * N;
      double sum = 0;
      for (std::size_t i = 0; i < N; ++i) {
        const std::int64_t p = v.positions[h * v.head_stride + i];
        if (p <= qpos[q]) sum += (row[i] = weight(h, qpos[q], p));
      }
      for (std::size_t i = 0; i < N; ++i) row[i] = static_cast<float>(2.0 * row[i] / sum);
    }
  }
  cache.observe_attention(AttentionObservation{probs.data(), v.batch, v.heads, Q, N, N, qpos});
}

std::vector<std::int64_t> iota_positions(std::int64_t first, std::size_t n) {
  std::vector<std::int64_t> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = first + static_cast<std::int64_t>(i);
  return p;
}

// A prompt, observed, then `decode` observed steps; the data depends on the seed only.
void drive(KVCache& cache, std::size_t H, std::size_t D, std::size_t prompt, std::size_t decode) {
  KV first(1, H, prompt, D, 5);
  const auto pos = iota_positions(0, prompt);
  cache.append(first.keys(), first.values(), pos);
  observe(cache, pos);
  for (std::size_t t = 0; t < decode; ++t) {
    KV step(1, H, 1, D, 1000 + static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{static_cast<std::int64_t>(prompt + t)};
    cache.append(step.keys(), step.values(), p);
    observe(cache, p);
  }
}

// Per head: position -> (fp16 key row, fp16 value row).
using Rows = std::vector<std::map<std::int64_t, std::pair<std::vector<std::uint16_t>, std::vector<std::uint16_t>>>>;
Rows rows_by_position(KVCache& cache) {
  const CacheView v = cache.materialize();
  Rows out(v.batch * v.heads);
  for (std::size_t h = 0; h < out.size(); ++h) {
    for (std::size_t i = 0; i < v.tokens; ++i) {
      const std::uint16_t* k = v.keys + (h * v.head_stride + i) * v.head_dim;
      const std::uint16_t* x = v.values + (h * v.head_stride + i) * v.head_dim;
      out[h][v.positions[h * v.head_stride + i]] = {std::vector<std::uint16_t>(k, k + v.head_dim),
                                                   std::vector<std::uint16_t>(x, x + v.head_dim)};
    }
  }
  return out;
}

std::vector<std::int64_t> kept_positions(const Rows& rows, std::size_t h) {
  std::vector<std::int64_t> out;
  for (const auto& [p, kv] : rows[h]) out.push_back(p);
  return out;
}

KVCacheConfig composed(const std::string& method, const std::string& storage) {
  KVCacheConfig c;
  c.method = method;
  c.storage = storage;
  c.kivi_bits = 4;
  c.kivi_group_size = 32;
  c.kivi_staging = 32;
  c.zipcache_staging = 32;
  c.h2o_budget = c.pyramidkv_budget = c.squeeze_budget = c.streaming_budget = 80;
  return c;
}

// Queries after every row: out [1, 1, Hq, D] of a cache.
std::vector<float> attend_last(const KVCache& cache, std::size_t Hq, std::size_t D, std::int64_t qpos, unsigned seed) {
  const auto q = normal_fp16(Hq * D, seed);
  std::vector<float> out(Hq * D);
  const std::vector<std::int64_t> p{qpos};
  cache.attend(QueryBlock{q.data(), 1, 1, Hq, D}, p, out.data());
  return out;
}

TEST(ComposedCache, FullOverKiviHoldsTheKiviCachesCodes) {
  // The eviction core without eviction over the kivi storage is the kivi cache: the same groups
  // of the same rows, so the same codes, bit for bit (a prompt of whole groups: the composed
  // storage compresses a prompt's short last group at once, the kivi cache lets it wait).
  KVCacheConfig c = composed("full", "kivi");
  KVCacheConfig k = c;
  k.method = "kivi";
  k.storage = "fp16";
  auto a = KVCacheFactory::create(c);
  auto b = KVCacheFactory::create(k);
  drive(*a, 3, 64, 96, 44);
  drive(*b, 3, 64, 96, 44);
  ASSERT_EQ(a->rows(), 140u);
  const CacheView va = a->materialize();
  const CacheView vb = b->materialize();
  ASSERT_EQ(va.tokens, vb.tokens);
  for (std::size_t h = 0; h < 3; ++h) {
    for (std::size_t i = 0; i < va.tokens; ++i) {
      ASSERT_EQ(va.positions[h * va.head_stride + i], vb.positions[h * vb.head_stride + i]);
      ASSERT_EQ(0, std::memcmp(va.keys + (h * va.head_stride + i) * 64, vb.keys + (h * vb.head_stride + i) * 64, 128)) << h << " " << i;
      ASSERT_EQ(0, std::memcmp(va.values + (h * va.head_stride + i) * 64, vb.values + (h * vb.head_stride + i) * 64, 128));
    }
  }
  const auto oa = attend_last(*a, 6, 64, 200, 9), ob = attend_last(*b, 6, 64, 200, 9);
  for (std::size_t i = 0; i < oa.size(); ++i) ASSERT_NEAR(oa[i], ob[i], 1e-4 * (1 + std::fabs(ob[i]))) << i;
  EXPECT_EQ(a->stats().figure("storage_staged_rows"), 140.0 - 128.0);
}

// The policy over its storage (config c) and the same policy over fp16 rows, given the same prompt.
struct PolicyPair {
  std::unique_ptr<KVCache> mixed, plain;
};
PolicyPair driven_pair(const KVCacheConfig& c, std::size_t H, std::size_t D, std::size_t prompt, unsigned seed) {
  KVCacheConfig f = c;
  f.storage = "fp16";
  f.kivi_staging = f.kivi_group_size;  // (a storage field, idle over fp16 rows)
  PolicyPair p{KVCacheFactory::create(c), KVCacheFactory::create(f)};
  drive(*p.mixed, H, D, prompt, seed);
  drive(*p.plain, H, D, prompt, seed);
  return p;
}

// The rows `mixed` (a policy over kivi storage, config c) holds right after a prompt's eviction
// are exactly what the storage-only kivi cache holds when given the rows `plain` (the same policy
// over fp16) kept, in position order (each head its own rows), as one block (staging 0): the
// groups the composed cache compresses a prompt's survivors into. Attention over both agrees.
void expect_survivors_in_storage_form(KVCache& mixed, KVCache& plain, const KVCacheConfig& c, std::size_t H,
                                      std::size_t D) {
  const std::size_t n = mixed.rows();
  const Rows rm = rows_by_position(mixed), rp = rows_by_position(plain);
  KVCacheConfig k = c;
  k.method = "kivi";
  k.storage = "fp16";
  k.kivi_staging = 0;
  auto only = KVCacheFactory::create(k);
  std::vector<float> keys(H * n * D), values(H * n * D);  // [1, H, n, D]
  for (std::size_t h = 0; h < H; ++h) {
    ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h)) << "head " << h;
    std::size_t i = 0;
    for (const auto& [p, kv] : rp[h]) {
      for (std::size_t d = 0; d < D; ++d) {
        keys[(h * n + i) * D + d] = fp16_to_f32(kv.first[d]);
        values[(h * n + i) * D + d] = fp16_to_f32(kv.second[d]);
      }
      ++i;
    }
  }
  only->append(make_block(keys.data(), 1, H, n, D), make_block(values.data(), 1, H, n, D),
               iota_positions(0, static_cast<std::int64_t>(n)));
  const CacheView vo = only->materialize();
  for (std::size_t h = 0; h < H; ++h) {
    std::size_t i = 0;
    for (const auto& [p, kv] : rm[h]) {
      ASSERT_EQ(0, std::memcmp(kv.first.data(), vo.keys + (h * vo.head_stride + i) * D, D * 2)) << h << " row " << i;
      ASSERT_EQ(0, std::memcmp(kv.second.data(), vo.values + (h * vo.head_stride + i) * D, D * 2)) << h << " row " << i;
      ++i;
    }
  }
  const auto om = attend_last(mixed, 6, D, 1000, 4), oo = attend_last(*only, 6, D, 1000, 4);
  for (std::size_t i = 0; i < om.size(); ++i) ASSERT_NEAR(om[i], oo[i], 1e-4 * (1 + std::fabs(oo[i]))) << i;
}

// The policy over kivi4 keeps the positions it keeps over fp16 (attention-scored, so the stored
// form does not change the scores), and right after the prompt's eviction holds exactly what the
// storage-only kivi cache holds when given those rows; attention over both agrees.
TEST(ComposedCache, H2oOverKiviKeepsH2osRowsInKiviForm) {
  constexpr std::size_t H = 3, D = 64, prompt = 300;
  const KVCacheConfig c = composed("h2o", "kivi");
  auto [mixed, plain] = driven_pair(c, H, D, prompt, 0);
  ASSERT_EQ(mixed->rows(), 80u);
  // Groups of 32, 32 and 16 rows.
  expect_survivors_in_storage_form(*mixed, *plain, c, H, D);
  if (::testing::Test::HasFatalFailure()) return;
  // 80 rows: every one compressed (a short last group), none left in fp16.
  EXPECT_EQ(mixed->stats().figure("storage_staged_rows"), 0.0);
}

TEST(ComposedCache, H2oOverKiviFollowsThePolicyThroughDecode) {
  constexpr std::size_t H = 2, D = 64, prompt = 200, decode = 90;
  const KVCacheConfig c = composed("h2o", "kivi");
  KVCacheConfig f = c;
  f.storage = "fp16";
  auto mixed = KVCacheFactory::create(c);
  auto plain = KVCacheFactory::create(f);
  drive(*mixed, H, D, prompt, decode);
  drive(*plain, H, D, prompt, decode);
  const Rows rm = rows_by_position(*mixed), rp = rows_by_position(*plain);
  // Every key/value channel's range over the whole input bounds the rounding of a 4-bit group.
  KV all_first(1, H, prompt, D, 5);
  for (std::size_t h = 0; h < H; ++h) {
    ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h)) << "head " << h;
    for (const auto& [p, kv] : rm[h]) {
      const auto& ref = rp[h].at(p);
      for (std::size_t d = 0; d < D; ++d) {
        // normal data: a 4-bit group of <= 32 rows spans < 8, so a step < 8/15, an error < 0.27.
        ASSERT_NEAR(fp16_to_f32(kv.first[d]), fp16_to_f32(ref.first[d]), 0.27f) << "head " << h << " pos " << p;
        ASSERT_NEAR(fp16_to_f32(kv.second[d]), fp16_to_f32(ref.second[d]), 0.27f);
      }
    }
  }
  // Attention over the composed cache is attention over its own rows.
  const CacheView v = mixed->materialize();
  const auto q = normal_fp16(4 * D, 12);
  std::vector<float> out(4 * D);
  const std::vector<std::int64_t> qp{static_cast<std::int64_t>(prompt + decode)};
  mixed->attend(QueryBlock{q.data(), 1, 1, 4, D}, qp, out.data());
  for (std::size_t hq = 0; hq < 4; ++hq) {
    const std::size_t g = hq / 2;
    std::vector<double> logit(v.tokens);
    double mx = -1e300;
    for (std::size_t i = 0; i < v.tokens; ++i) {
      double dot = 0;
      for (std::size_t d = 0; d < D; ++d) dot += q[hq * D + d] * fp16_to_f32(v.keys[(g * v.head_stride + i) * D + d]);
      logit[i] = dot / 8.0;
      mx = std::max(mx, logit[i]);
    }
    double sum = 0;
    std::vector<double> o(D, 0.0);
    for (std::size_t i = 0; i < v.tokens; ++i) {
      const double w = std::exp(logit[i] - mx);
      sum += w;
      for (std::size_t d = 0; d < D; ++d) o[d] += w * fp16_to_f32(v.values[(g * v.head_stride + i) * D + d]);
    }
    for (std::size_t d = 0; d < D; ++d) ASSERT_NEAR(out[hq * D + d], o[d] / sum, 4e-3 * (1 + std::fabs(o[d] / sum)));
  }
}

TEST(ComposedCache, LongDecodeRepacksThinnedGroups) {
  // 700 decode steps at a budget of 80: evictions thin the old groups; the storage re-packs them,
  // so it never holds more than 4x the groups its rows need, and the policy's rows stay.
  constexpr std::size_t H = 2, D = 64;
  const KVCacheConfig c = composed("h2o", "kivi");
  KVCacheConfig f = c;
  f.storage = "fp16";
  auto mixed = KVCacheFactory::create(c);
  auto plain = KVCacheFactory::create(f);
  KV first(1, H, 100, D, 5);
  mixed->append(first.keys(), first.values(), iota_positions(0, 100));
  plain->append(first.keys(), first.values(), iota_positions(0, 100));
  observe(*mixed, iota_positions(0, 100));
  observe(*plain, iota_positions(0, 100));
  const auto* storage = dynamic_cast<const PackedRows*>(&dynamic_cast<const EvictionCache&>(*mixed).core().storage());
  ASSERT_NE(storage, nullptr);
  for (std::size_t t = 0; t < 700; ++t) {
    KV step(1, H, 1, D, 2000 + static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{static_cast<std::int64_t>(100 + t)};
    for (KVCache* cache : {mixed.get(), plain.get()}) {
      cache->append(step.keys(), step.values(), p);
      observe(*cache, p);
    }
    for (const auto& head : storage->heads()) {
      ASSERT_LE(head.blocks.size(), std::max<std::size_t>(3, 4 * ((head.packed + 31) / 32))) << "step " << t;
    }
  }
  const Rows rm = rows_by_position(*mixed), rp = rows_by_position(*plain);
  for (std::size_t h = 0; h < H; ++h) {
    ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h));
    const std::size_t repacks = storage->heads()[h].repacks;
    EXPECT_GE(repacks, 1u) << "the test never thinned the groups enough to re-pack";
    // One rounding per re-pack a row survived, plus the first, each under half a step of a group
    // spanning < 8.
    const float bound = 0.27f * static_cast<float>(1 + repacks);
    for (const auto& [p, kv] : rm[h]) {
      for (std::size_t d = 0; d < D; ++d) {
        ASSERT_NEAR(fp16_to_f32(kv.first[d]), fp16_to_f32(rp[h].at(p).first[d]), bound) << p;
        ASSERT_NEAR(fp16_to_f32(kv.second[d]), fp16_to_f32(rp[h].at(p).second[d]), bound) << p;
      }
    }
  }
}

TEST(ComposedCache, BytesFallAsPolicyAndStoragePredict) {
  // Composed bytes = the policy's metadata (fp16 h2o's bytes minus its fp16 rows) + the storage's
  // bytes for the kept rows (the kivi cache holding them, minus its own position table).
  constexpr std::size_t H = 4, D = 128, prompt = 512;
  const KVCacheConfig c = composed("h2o", "kivi");
  auto [mixed, plain] = driven_pair(c, H, D, prompt, 1);
  const CacheStats sm = mixed->stats(), sp = plain->stats();
  ASSERT_EQ(sm.tokens_kept, sp.tokens_kept);
  KVCacheConfig k = c;
  k.method = "kivi";
  k.storage = "fp16";
  k.kivi_staging = 0;  // one block of the kept rows: every one compressed, as a prompt's survivors
  auto only = KVCacheFactory::create(k);
  KV rows(1, H, sm.tokens_kept, D, 77);
  only->append(rows.keys(), rows.values(), iota_positions(0, sm.tokens_kept));
  const double fp16_rows = static_cast<double>(sp.tokens_kept * H * D * 2 * 2);
  const double metadata = static_cast<double>(sp.resident_bytes) - fp16_rows;
  const double storage = static_cast<double>(only->stats().resident_bytes) - static_cast<double>(sm.tokens_kept * 8);
  const double predicted = metadata + storage;
  EXPECT_NEAR(static_cast<double>(sm.resident_bytes), predicted, 0.06 * predicted)
      << "composed " << sm.resident_bytes << " fp16 h2o " << sp.resident_bytes << " kivi rows " << storage;
  // 81 rows: 4-bit codes, fp16 group parameters, bookkeeping (the last step's row in fp16), and the
  // policy's 16 bytes per row, against fp16 rows and the same 16 bytes.
  EXPECT_LT(static_cast<double>(sm.resident_bytes), 0.4 * static_cast<double>(sp.resident_bytes));
  // And far below the storage alone holding every token: 81 of 513 tokens (16 %), plus the
  // policy's 16 bytes per row.
  auto every = KVCacheFactory::create(k);
  KV all(1, H, prompt + 1, D, 78);
  every->append(all.keys(), all.values(), iota_positions(0, prompt + 1));
  EXPECT_LT(static_cast<double>(sm.resident_bytes), 0.3 * static_cast<double>(every->stats().resident_bytes));
}

// Keys of layer l concentrated by a shared direction of weight l: the layers' key dispersion differs,
// so squeeze's schedule gives them different budgets.
void drive_model(CacheSet& set, std::size_t layers, std::size_t H, std::size_t D, std::size_t prompt, std::size_t decode) {
  const auto pos = iota_positions(0, prompt);
  for (std::size_t l = 0; l < layers; ++l) {
    KV kv(1, H, prompt, D, 30 + static_cast<unsigned>(l));
    for (std::size_t i = 0; i < kv.k.size(); ++i) kv.k[i] = fp16_to_f32(f32_to_fp16(kv.k[i] + 1.5f * static_cast<float>(l) * ((i % D) == 0 ? 1.0f : 0.0f)));
    set.at(l).append(kv.keys(), kv.values(), pos);
    observe(set.at(l), pos);
  }
  for (std::size_t t = 0; t < decode; ++t) {
    for (std::size_t l = 0; l < layers; ++l) {
      KV step(1, H, 1, D, 500 + static_cast<unsigned>(t * layers + l));
      const std::vector<std::int64_t> p{static_cast<std::int64_t>(prompt + t)};
      set.at(l).append(step.keys(), step.values(), p);
      observe(set.at(l), p);
    }
  }
}

TEST(ComposedCache, SqueezeOverZipcacheIsBothSeedsInOneCache) {
  // Per-layer token budgets (squeeze) x per-token precision (zipcache) in one cache: each layer
  // keeps the rows squeeze keeps over fp16, at its resolved budget, in mixed precision.
  constexpr std::size_t L = 4, H = 2, D = 64;
  KVCacheConfig c = composed("squeeze", "zipcache");
  c.squeeze_budget = 96;
  c.zipcache_saliency = "attention_normalized";
  KVCacheConfig f = c;
  f.storage = "fp16";
  CacheSet mixed = KVCacheBuilder::for_model(ModelSpec::uniform(L, H, D), c);
  CacheSet plain = KVCacheBuilder::for_model(ModelSpec::uniform(L, H, D), f);
  drive_model(mixed, L, H, D, 400, 40);
  drive_model(plain, L, H, D, 400, 40);
  std::set<std::size_t> budgets;
  std::size_t mixed_blocks = 0;
  for (std::size_t l = 0; l < L; ++l) {
    const auto budget = mixed.coordinator()->resolved_budget(static_cast<int>(l));
    ASSERT_TRUE(budget.has_value());
    EXPECT_EQ(mixed.at(l).rows(), static_cast<std::size_t>(*budget)) << "layer " << l;
    budgets.insert(static_cast<std::size_t>(*budget));
    const Rows rm = rows_by_position(mixed.at(l)), rp = rows_by_position(plain.at(l));
    for (std::size_t h = 0; h < H; ++h) ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h)) << "layer " << l << " head " << h;
    const auto* eviction = dynamic_cast<const EvictionCache*>(&mixed.at(l));
    ASSERT_NE(eviction, nullptr);
    const auto* storage = dynamic_cast<const PackedRows*>(&eviction->core().storage());
    ASSERT_NE(storage, nullptr);
    for (const auto& head : storage->heads()) {
      for (const auto& block : head.blocks) mixed_blocks += block.keys.n_hi > 0 && block.keys.n_hi < block.tokens;
    }
  }
  EXPECT_GT(budgets.size(), 1u) << "squeeze gave every layer the same budget: the test data does not separate them";
  EXPECT_GT(mixed_blocks, 0u);
  // Keys at 4/2 bits, values at 4, fp16 group parameters per set, bookkeeping, the policy's 16
  // bytes per row and up to 31 fp16 rows per head, against fp16 rows and the same 16 bytes.
  EXPECT_LT(mixed.resident_bytes(), plain.resident_bytes() * 60 / 100);
}

TEST(ComposedCache, PyramidkvOverKiviHoldsTheTaper) {
  constexpr std::size_t L = 6, H = 2, D = 64;
  KVCacheConfig c = composed("pyramidkv", "kivi");
  c.pyramidkv_budget = 96;
  KVCacheConfig f = c;
  f.storage = "fp16";
  CacheSet mixed = KVCacheBuilder::for_model(ModelSpec::uniform(L, H, D), c);
  CacheSet plain = KVCacheBuilder::for_model(ModelSpec::uniform(L, H, D), f);
  drive_model(mixed, L, H, D, 300, 20);
  drive_model(plain, L, H, D, 300, 20);
  for (std::size_t l = 0; l < L; ++l) {
    EXPECT_EQ(mixed.at(l).rows(), plain.at(l).rows()) << "layer " << l;
    const Rows rm = rows_by_position(mixed.at(l)), rp = rows_by_position(plain.at(l));
    for (std::size_t h = 0; h < H; ++h) ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h)) << "layer " << l;
  }
  EXPECT_GT(mixed.at(0).rows(), mixed.at(L - 1).rows());
  // 4-bit codes + fp16 group parameters + block bookkeeping + the policy's 16 bytes per row, and
  // the 20 decode steps' rows still in fp16 (a group forms at 32), against fp16 rows and the same
  // 16 bytes.
  EXPECT_LT(mixed.resident_bytes(), plain.resident_bytes() * 60 / 100);
}

TEST(ComposedCache, StreamingOverKiviKeepsTheSameWindow) {
  // No scores: the newcomer replaces the oldest evictable row. A compressed storage cannot take it
  // in that slot: the victim is erased and the newcomer appended; the same positions stay.
  KVCacheConfig c = composed("streaming", "kivi");
  c.streaming_budget = 70;
  KVCacheConfig f = c;
  f.storage = "fp16";
  auto mixed = KVCacheFactory::create(c);
  auto plain = KVCacheFactory::create(f);
  drive(*mixed, 2, 64, 150, 50);
  drive(*plain, 2, 64, 150, 50);
  const Rows rm = rows_by_position(*mixed), rp = rows_by_position(*plain);
  for (std::size_t h = 0; h < 2; ++h) EXPECT_EQ(kept_positions(rm, h), kept_positions(rp, h));
  EXPECT_EQ(mixed->rows(), 70u);
}

TEST(ComposedCache, KeyProxyPolicyOverZipcacheHoldsItsBudget) {
  // The documented core scores by the incoming key against the stored keys: over a compressed
  // storage it reads the decoded keys (a slow path), and the budget holds at every step.
  KVCacheConfig c = testing::config_for("h2o");
  c.storage = "zipcache";
  c.zipcache_staging = 32;
  c.h2o_budget = 64;
  auto cache = KVCacheFactory::create(c);
  KV first(1, 2, 130, 64, 8);
  cache->append(first.keys(), first.values(), iota_positions(0, 130));
  EXPECT_EQ(cache->rows(), 64u);
  for (std::size_t t = 0; t < 40; ++t) {
    KV step(1, 2, 1, 64, 300 + static_cast<unsigned>(t));
    cache->append(step.keys(), step.values(), std::vector<std::int64_t>{130 + static_cast<std::int64_t>(t)});
    ASSERT_EQ(cache->rows(), 64u);
  }
  const Rows r = rows_by_position(*cache);
  for (std::int64_t sink = 0; sink < 4; ++sink) EXPECT_TRUE(r[0].count(sink) && r[1].count(sink)) << "sink " << sink;
}

TEST(ComposedCache, ErasingARowKeepsEveryOtherRowsCodes) {
  constexpr std::size_t S = 32, D = 64;
  const auto x = normal_fp16(S * D, 3);
  std::vector<const float*> rows(S);
  for (std::size_t s = 0; s < S; ++s) rows[s] = x.data() + s * D;
  std::vector<std::uint8_t> mask(S, 0);
  for (std::size_t s : {1u, 5u, 6u, 20u, 31u}) mask[s] = 1;
  ZipCompressed z = quant::zip_compress_rows(rows.data(), S, D, mask.data(), 4, 2, S);
  const std::vector<std::uint16_t> before = zip_reconstruct(z);
  std::vector<std::size_t> alive(S);
  for (std::size_t s = 0; s < S; ++s) alive[s] = s;
  for (std::size_t r : {5u, 0u, 29u, 4u, 0u, 16u}) {  // indices into the current block
    erase_block_row(z, r);
    alive.erase(alive.begin() + static_cast<std::ptrdiff_t>(r));
    const std::vector<std::uint16_t> after = zip_reconstruct(z);
    ASSERT_EQ(after.size(), alive.size() * D);
    for (std::size_t i = 0; i < alive.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(after.data() + i * D, before.data() + alive[i] * D, D * 2)) << "row " << alive[i];
    }
  }
  // Every salient row gone but one, then that one: the mask disappears with the second set.
  while (z.n_hi > 0) {
    std::size_t r = 0;
    while (!z.salient(r)) ++r;
    erase_block_row(z, r);
  }
  EXPECT_TRUE(z.mask_bits.empty());
  EXPECT_EQ(z.hi.rows, 0u);
  EXPECT_EQ(z.lo.rows, z.seq_len);
}

TEST(ComposedCache, StagingBelowTheGroupCompressesDecodeRowsInShortGroups) {
  // Groups of 64 rows for the prompt's survivors, decode rows compressed 16 at a time: never 16
  // rows in fp16, and the rows stay those of the policy, within one 4-bit rounding.
  KVCacheConfig c = composed("h2o", "kivi");
  c.kivi_group_size = 64;
  c.kivi_staging = 16;
  KVCacheConfig f = c;
  f.storage = "fp16";
  f.kivi_staging = 64;  // (the fp16 cache's kivi fields describe the kivi method: whole groups)
  auto mixed = KVCacheFactory::create(c);
  auto plain = KVCacheFactory::create(f);
  KV first(1, 2, 200, 64, 5);
  for (KVCache* cache : {mixed.get(), plain.get()}) {
    cache->append(first.keys(), first.values(), iota_positions(0, 200));
    observe(*cache, iota_positions(0, 200));
  }
  for (std::size_t t = 0; t < 50; ++t) {
    KV step(1, 2, 1, 64, 700 + static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{200 + static_cast<std::int64_t>(t)};
    for (KVCache* cache : {mixed.get(), plain.get()}) {
      cache->append(step.keys(), step.values(), p);
      observe(*cache, p);
    }
    ASSERT_LT(mixed->stats().figure("storage_staged_rows"), 16.0) << "step " << t;
  }
  const Rows rm = rows_by_position(*mixed), rp = rows_by_position(*plain);
  for (std::size_t h = 0; h < 2; ++h) {
    ASSERT_EQ(kept_positions(rm, h), kept_positions(rp, h));
    for (const auto& [p, kv] : rm[h]) {
      for (std::size_t d = 0; d < 64; ++d) ASSERT_NEAR(fp16_to_f32(kv.second[d]), fp16_to_f32(rp[h].at(p).second[d]), 0.3f) << p;
    }
  }
  // The kivi method itself still compresses whole groups only.
  KVCacheConfig k = c;
  k.method = "kivi";
  k.storage = "fp16";
  EXPECT_THROW(k.validate(), ConfigError);
}

// 3-bit storage under a policy (issue 27's h2o+kivi3_g64): the policy keeps the rows it keeps over
// fp16, the prompt's survivors hold exactly the codes of the storage-only kivi3_g64 cache given
// those rows (groups of 64 and 16), decode rows go 16 at a time, and a kept row costs less than at
TEST(ComposedCache, H2oOverKivi3InGroupsOf64HoldsTheKivi3Codes) {
  constexpr std::size_t H = 3, D = 64, prompt = 300;
  KVCacheConfig c = composed("h2o", "kivi");
  c.kivi_bits = 3;
  c.kivi_group_size = 64;
  c.kivi_staging = 16;
  auto [mixed, plain] = driven_pair(c, H, D, prompt, 0);
  ASSERT_EQ(mixed->rows(), 80u);
  expect_survivors_in_storage_form(*mixed, *plain, c, H, D);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(mixed->stats().figure("storage_staged_rows"), 0.0);

  // Decode: rows compressed 16 at a time, the budget held, fewer bytes than the same policy at 4 bits.
  KVCacheConfig c4 = c;
  c4.kivi_bits = 4;
  auto four = KVCacheFactory::create(c4);
  drive(*four, H, D, prompt, 0);
  for (std::size_t t = 0; t < 40; ++t) {
    KV step(1, H, 1, D, 900 + static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{static_cast<std::int64_t>(prompt + t)};
    for (KVCache* cache : {mixed.get(), four.get()}) {
      cache->append(step.keys(), step.values(), p);
      observe(*cache, p);
    }
    ASSERT_LT(mixed->stats().figure("storage_staged_rows"), 16.0) << "step " << t;
    ASSERT_EQ(mixed->rows(), 80u) << "step " << t;
  }
  EXPECT_EQ(mixed->stats().figure("hi_bits"), 3.0);
  EXPECT_LT(mixed->stats().resident_bytes, four->stats().resident_bytes);
}

TEST(ComposedCache, ConfigNamesTheStorage) {
  KVCacheConfig c;
  c.method = "h2o";
  c.set("storage", "kivi");
  EXPECT_NO_THROW(c.validate());
  auto expect_error = [](KVCacheConfig bad, const std::string& what, const std::string& field = "storage") {
    try {
      bad.validate();
      ADD_FAILURE() << what << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  c.storage = "int3";
  expect_error(c, "unknown storage");
  c.storage = "kivi";
  c.method = "kivi";
  expect_error(c, "a storage under the kivi method");
  // On a GPU: kivi and zipcache codes under the eviction policies (the device rules on their
  // fields); either under full (methods kivi and zipcache are that) is refused.
  c.method = "h2o";
  c.device = "cuda";
  EXPECT_NO_THROW(c.validate());
  c.kivi_key_bits = 3;
  expect_error(c, "3-bit kivi keys on a GPU", "kivi_key_bits");
  c.kivi_key_bits = -1;
  c.method = "streaming";
  EXPECT_NO_THROW(c.validate());
  c.method = "full";
  expect_error(c, "kivi storage under full on a GPU");
  c.method = "h2o";
  c.storage = "zipcache";
  EXPECT_NO_THROW(c.validate());
  c.method = "squeeze";
  EXPECT_NO_THROW(c.validate());
  c.zipcache_lo_bits = 3;
  expect_error(c, "3-bit zipcache keys on a GPU", "zipcache_lo_bits");
  c.zipcache_lo_bits = 2;
  c.zipcache_saliency = "attention_normalized";
  expect_error(c, "attention saliency of a zipcache storage on a GPU", "zipcache_saliency");
  c.zipcache_saliency = "key_norm";
  c.method = "full";
  expect_error(c, "zipcache storage under full on a GPU");
  c.method = "h2o";
  c.device = "cpu";
  c.storage = "zipcache";
  EXPECT_EQ(KVCacheFactory::create(c)->method(), "h2o");
}

}  // namespace
}  // namespace kvslim
