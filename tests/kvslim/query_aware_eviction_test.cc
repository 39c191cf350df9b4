// The query-aware eviction profile (evict_profile = "query_aware", the default of h2o, squeeze and
// pyramidkv): a recent window that fits every budget, the SnapKV-style prefill (observation window,
// max-pooling over positions), normalised or decayed attention, and the key-proxy fallback for an
// integrator that reports no attention. The documented core stays one switch away ("original").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cache/eviction_cache.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::sorted_positions;

KVCacheConfig query_aware(int budget, int n_sink = 2) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  c.h2o_n_sink = n_sink;
  return c;  // every evict_* field at its default: the query-aware profile
}

// Causal attention of S queries over S rows (one KV head): every query gives `base` to each row
// it sees and `hot` to the rows in `favoured` that it sees; [S, S].
std::vector<float> prompt_attention(std::size_t S, std::size_t q_begin, const std::vector<std::int64_t>& favoured,
                                    float base = 0.01f, float hot = 0.5f) {
  std::vector<float> probs(S * S, 0.0f);
  for (std::size_t q = q_begin; q < S; ++q) {
    for (std::size_t i = 0; i <= q; ++i) probs[q * S + i] = base;
    for (std::int64_t f : favoured) {
      if (static_cast<std::size_t>(f) <= q) probs[q * S + f] = hot;
    }
  }
  return probs;
}

std::vector<std::int64_t> iota_positions(std::size_t n, std::int64_t first = 0) {
  std::vector<std::int64_t> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = first + static_cast<std::int64_t>(i);
  return p;
}

bool kept(const CacheView& v, std::int64_t pos) {
  const auto p = sorted_positions(v);
  return std::binary_search(p.begin(), p.end(), pos);
}

TEST(QueryAware, DefaultsAreTheQueryAwareProfile) {
  const EvictionPolicy p = make_eviction_policy(KVCacheConfig{}, 4);
  EXPECT_EQ(p.scoring, Scoring::attention_normalized);
  EXPECT_EQ(p.recent_window, 32u);
  EXPECT_TRUE(p.recent_fits_budget);
  EXPECT_EQ(p.obs_window, 16u);
  EXPECT_EQ(p.pool_kernel, 15u);
  EXPECT_EQ(p.decay, 1.0f);
  KVCacheConfig o;
  o.evict_profile = "original";
  const EvictionPolicy q = make_eviction_policy(o, 4);
  EXPECT_EQ(q.scoring, Scoring::key_proxy);
  EXPECT_EQ(q.recent_window, 0u);
  EXPECT_EQ(q.obs_window, 0u);
  EXPECT_EQ(q.pool_kernel, 1u);
  // A field set explicitly overrides the profile.
  o.evict_recent_window = 8;
  o.evict_scoring = "attention";
  EXPECT_EQ(make_eviction_policy(o, 4).recent_window, 8u);
  EXPECT_FALSE(make_eviction_policy(o, 4).recent_fits_budget);
  EXPECT_EQ(make_eviction_policy(o, 4).scoring, Scoring::attention);
}

// The prompt's last queries decide: a token only the early queries attended is dropped, the one
// the question (the last obs_window queries) attends is kept with its pooled neighbours.
TEST(QueryAware, PrefillKeepsWhatTheLastQueriesAttend) {
  const std::size_t S = 64;
  KVCacheConfig c = query_aware(16);
  c.evict_obs_window = 8;
  c.evict_pool_kernel = 5;
  auto cache = KVCacheFactory::create(c);
  ASSERT_TRUE(cache->needs().attention);
  KV kv(1, 1, S, 8, 3);
  const auto pos = iota_positions(S);
  const CacheView v = cache->update_and_fetch(kv.keys(), kv.values(), pos);
  ASSERT_EQ(v.tokens, S);  // appended whole, evicted when its attention arrives
  // Queries 0..55 favour token 10; the last 8 favour token 30.
  auto probs = prompt_attention(S, 0, {10});
  const auto late = prompt_attention(S, S - 8, {30});
  std::copy(late.begin() + (S - 8) * S, late.end(), probs.begin() + (S - 8) * S);
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  const CacheView after = cache->view();
  EXPECT_EQ(after.tokens, 16u);
  EXPECT_TRUE(kept(after, 0) && kept(after, 1));  // sinks
  for (std::int64_t p = 28; p <= 32; ++p) EXPECT_TRUE(kept(after, p)) << p;  // 30 and its neighbours
  EXPECT_FALSE(kept(after, 10));
  for (std::int64_t p = 59; p < 64; ++p) EXPECT_TRUE(kept(after, p)) << p;  // recent window (16 - 2) / 2 = 7

  // Every query scoring (no window): the early favourite wins instead.
  c.evict_obs_window = 0;
  auto all = KVCacheFactory::create(c);
  all->update_and_fetch(kv.keys(), kv.values(), pos);
  all->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  EXPECT_TRUE(kept(all->view(), 10));
}

TEST(QueryAware, ObservingOnlyTheWindowQueriesEqualsObservingAll) {
  // needs().attention_queries lets an engine observe only a prefill's last queries (a 32k-token
  // prompt's full observation would be tens of GB). The trimmed observation must leave the cache
  // exactly as the full one: rows, positions and scores, with decay, pooling and the window of 1
  // (for which 2 queries are asked, so the trimmed step still reads as a prefill).
  const std::size_t S = 96, H = 2;
  for (const int window : {1, 5, 16}) {
    for (const double decay : {1.0, 0.9}) {
      SCOPED_TRACE("window " + std::to_string(window) + " decay " + std::to_string(decay));
      KVCacheConfig c = query_aware(24);
      c.evict_obs_window = window;
      c.evict_decay = decay;
      auto full = KVCacheFactory::create(c), trimmed = KVCacheFactory::create(c);
      const std::size_t n = trimmed->needs().attention_queries;
      ASSERT_EQ(n, static_cast<std::size_t>(std::max(window, 2)));
      KV kv(1, H, S, 8, 5);
      const auto pos = iota_positions(S);
      full->update_and_fetch(kv.keys(), kv.values(), pos);
      trimmed->update_and_fetch(kv.keys(), kv.values(), pos);
      // [H, S, S] causal attention with a different favourite per head and query.
      std::vector<float> probs(H * S * S, 0.0f);
      for (std::size_t h = 0; h < H; ++h) {
        for (std::size_t q = 0; q < S; ++q) {
          auto row = prompt_attention(S, 0, {static_cast<std::int64_t>((q * 7 + h * 13) % (q + 1))}, 0.01f, 0.3f);
          std::copy_n(row.begin() + q * S, S, probs.begin() + (h * S + q) * S);
        }
      }
      full->observe_attention(AttentionObservation{probs.data(), 1, H, S, S, S, pos});
      std::vector<float> last(H * n * S);
      for (std::size_t h = 0; h < H; ++h) {
        std::copy_n(probs.begin() + (h * S + S - n) * S, n * S, last.begin() + h * n * S);
      }
      trimmed->observe_attention(AttentionObservation{last.data(), 1, H, n, S, S, std::span(pos).subspan(S - n)});
      const auto& a = dynamic_cast<const EvictionCache&>(*full).core();
      const auto& b = dynamic_cast<const EvictionCache&>(*trimmed).core();
      ASSERT_EQ(a.rows(), b.rows());
      for (std::size_t h = 0; h < H; ++h) {
        for (std::size_t i = 0; i < a.rows(); ++i) {
          EXPECT_EQ(a.positions(h)[i], b.positions(h)[i]);
          EXPECT_EQ(a.scores(h)[i], b.scores(h)[i]);
        }
      }
    }
  }
  // No window: every query counts, so nothing may be trimmed.
  KVCacheConfig every = query_aware(24);
  every.evict_obs_window = 0;
  EXPECT_EQ(KVCacheFactory::create(every)->needs().attention_queries, 0u);
}

TEST(QueryAware, PoolingKeepsTheNeighboursOfAnAttendedToken) {
  const std::size_t S = 48;
  for (int kernel : {1, 5}) {
    KVCacheConfig c = query_aware(14);
    c.evict_pool_kernel = kernel;
    auto cache = KVCacheFactory::create(c);
    KV kv(1, 1, S, 8, 4);
    const auto pos = iota_positions(S);
    cache->update_and_fetch(kv.keys(), kv.values(), pos);
    // Token 20 is hot; everything else gets a little, decreasing with position (so without
    // pooling the neighbours of 20 are not preferred).
    auto probs = prompt_attention(S, 0, {20});
    for (std::size_t q = 0; q < S; ++q) {
      for (std::size_t i = 0; i <= q; ++i) {
        if (i != 20) probs[q * S + i] = 0.001f * static_cast<float>(S - i);
      }
    }
    cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
    const CacheView v = cache->view();
    EXPECT_TRUE(kept(v, 20));
    EXPECT_EQ(kept(v, 18) && kept(v, 19) && kept(v, 21) && kept(v, 22), kernel == 5) << kernel;
  }
}

// The freeze of the documented core is gone: decode tokens replace old ones, the newest stay.
TEST(QueryAware, DecodeKeepsTheNewestTokensAndStaysWithinBudget) {
  KVCacheConfig c = query_aware(12);
  auto cache = KVCacheFactory::create(c);
  std::int64_t next = 0;
  for (unsigned s = 0; s < 40; ++s) {
    KV kv(1, 1, 1, 8, 100 + s);
    const auto pos = iota_positions(1, next++);
    const CacheView v = cache->update_and_fetch(kv.keys(), kv.values(), pos);
    std::vector<float> probs(v.tokens, 1.0f / static_cast<float>(v.tokens));
    cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 1, v.tokens, v.tokens, pos});
    ASSERT_LE(cache->view().tokens, 12u);
  }
  const CacheView v = cache->view();
  EXPECT_TRUE(kept(v, 0) && kept(v, 1));
  for (std::int64_t p = 35; p < 40; ++p) EXPECT_TRUE(kept(v, p)) << p;  // window (12 - 2) / 2 = 5

  // The documented core, same stream (key proxy): frozen on the first 12 positions.
  c.evict_profile = "original";
  auto frozen = KVCacheFactory::create(c);
  for (unsigned s = 0; s < 40; ++s) {
    KV kv(1, 1, 1, 8, 100 + s);
    frozen->update_and_fetch(kv.keys(), kv.values());
  }
  EXPECT_EQ(sorted_positions(frozen->view()), iota_positions(12));
}

TEST(QueryAware, RecentWindowFitsEveryBudget) {
  // Budget 5 with 2 sinks: the auto window shrinks to (5 - 2) / 2 = 1, so eviction still works.
  KVCacheConfig c = query_aware(5);
  c.evict_pool_kernel = 5;
  auto cache = KVCacheFactory::create(c);
  KV kv(1, 1, 20, 8, 5);
  const auto pos = iota_positions(20);
  cache->update_and_fetch(kv.keys(), kv.values(), pos);
  const auto probs = prompt_attention(20, 0, {7});
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 20, 20, 20, pos});
  const CacheView v = cache->view();
  EXPECT_EQ(v.tokens, 5u);
  EXPECT_TRUE(kept(v, 0) && kept(v, 1) && kept(v, 19));  // sinks, the one-token window
  int hot = 0;  // the other two come from 7 and its pooled neighbours
  for (std::int64_t p = 5; p <= 9; ++p) hot += kept(v, p) ? 1 : 0;
  EXPECT_EQ(hot, 2);
}

// An integrator that never reports attention still gets a bounded cache: at the second
// unobserved update the cache scores by the key proxy.
TEST(QueryAware, FallsBackToTheKeyProxyWithoutObservations) {
  auto cache = KVCacheFactory::create(query_aware(10));
  auto& ec = dynamic_cast<const EvictionCache&>(*cache);
  KV prompt(1, 2, 30, 8, 6);
  EXPECT_EQ(cache->update_and_fetch(prompt.keys(), prompt.values()).tokens, 30u);
  EXPECT_FALSE(ec.core().fell_back());
  for (unsigned s = 0; s < 5; ++s) {
    KV kv(1, 2, 1, 8, 60 + s);
    EXPECT_LE(cache->update_and_fetch(kv.keys(), kv.values()).tokens, 10u);
  }
  EXPECT_TRUE(ec.core().fell_back());
  EXPECT_FALSE(cache->needs().attention);
  cache->reset();
  EXPECT_FALSE(ec.core().fell_back());
  EXPECT_TRUE(cache->needs().attention);
}

TEST(QueryAware, DecayForgetsOldAttention) {
  // Token 1 was attended by queries 1-3, token 2 by query 4 only. Budget 3 = sink 0 + recent 4 +
  // one of them: the plain sum keeps 1 (3 > 1); with decay 0.5 per query, 1 scores
  // 0.5 + 0.25 + 0.125 = 0.875 < 1 and the recent favourite 2 stays.
  for (double decay : {1.0, 0.5}) {
    KVCacheConfig c = query_aware(3, 1);
    c.evict_scoring = "attention";
    c.evict_decay = decay;
    c.evict_recent_window = 1;
    c.evict_pool_kernel = 1;
    auto cache = KVCacheFactory::create(c);
    KV kv(1, 1, 5, 8, 7);
    const auto pos = iota_positions(5);
    cache->update_and_fetch(kv.keys(), kv.values(), pos);
    std::vector<float> probs(5 * 5, 0.0f);
    const std::size_t target[] = {0, 1, 1, 1, 2};
    for (std::size_t q = 0; q < 5; ++q) probs[q * 5 + target[q]] = 1.0f;
    cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 5, 5, 5, pos});
    const std::vector<std::int64_t> expect = {0, decay == 1.0 ? 1 : 2, 4};
    EXPECT_EQ(sorted_positions(cache->view()), expect) << decay;
  }
}

// A prompt's observation over many heads is scored on several threads (eviction_core.cc): a batch
// of 8 sequences decides, sequence by sequence, exactly what each decides alone (one thread).
TEST(QueryAware, AThreadedObservationKeepsWhatEachSequenceKeepsAlone) {
  const std::size_t B = 8, H = 2, S = 8192, D = 16, Q = 16;  // 2.1e6 > the threads' threshold; alone 2.6e5
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<float> k(B * H * S * D), probs(B * H * Q * S);
  for (auto& x : k) x = u(rng) - 0.5f;
  for (std::size_t r = 0; r < B * H * Q; ++r) {  // each query's weights over the rows it sees, summing to 1
    const std::size_t q = S - Q + r % Q;
    float sum = 0.f;
    for (std::size_t i = 0; i <= q; ++i) sum += probs[r * S + i] = std::pow(u(rng), 8.f);
    for (std::size_t i = 0; i <= q; ++i) probs[r * S + i] /= sum;
  }
  const std::vector<std::int64_t> pos = iota_positions(S), qpos(pos.end() - Q, pos.end());
  auto batched = KVCacheFactory::create(query_aware(512));
  batched->append(make_block(k.data(), B, H, S, D), make_block(k.data(), B, H, S, D), pos);
  batched->observe_attention(AttentionObservation{probs.data(), B, H, Q, S, S, qpos});
  const CacheView all = batched->materialize();
  for (std::size_t b = 0; b < B; ++b) {
    auto alone = KVCacheFactory::create(query_aware(512));
    const float* kb = k.data() + b * H * S * D;
    alone->append(make_block(kb, 1, H, S, D), make_block(kb, 1, H, S, D), pos);
    alone->observe_attention(AttentionObservation{probs.data() + b * H * Q * S, 1, H, Q, S, S, qpos});
    const CacheView one = alone->materialize();
    ASSERT_EQ(one.tokens, all.tokens);
    for (std::size_t h = 0; h < H; ++h) {
      for (std::size_t i = 0; i < one.tokens; ++i) {
        ASSERT_EQ(one.position(0, h, i), all.position(b, h, i)) << "sequence " << b << " head " << h << " slot " << i;
      }
    }
  }
}

}  // namespace
}  // namespace kvslim
