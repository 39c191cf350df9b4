// Prior scores (kvslim/prior_scores.h, issue 27): an importance per (head, position) handed to an
// attention-scored H2O-core cache before its prefill, ranked with the observation window's own
// attention; used by that prefill alone.
#include "kvslim/prior_scores.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "kvslim/errors.h"
#include "kvslim/factory.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::sorted_positions;

constexpr std::size_t S = 64;

KVCacheConfig h2o(int budget) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = budget;
  c.h2o_n_sink = 2;
  c.evict_pool_kernel = 1;  // no pooling: the kept rows are exactly the scored ones
  return c;
}

// Uniform causal attention: a window that favours nothing (a question not asked yet).
std::vector<float> flat_attention() {
  std::vector<float> probs(S * S, 0.0f);
  for (std::size_t q = 0; q < S; ++q) {
    for (std::size_t i = 0; i <= q; ++i) probs[q * S + i] = 1.0f / static_cast<float>(q + 1);
  }
  return probs;
}

std::vector<std::int64_t> iota(std::size_t n, std::int64_t first = 0) {
  std::vector<std::int64_t> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = first + static_cast<std::int64_t>(i);
  return p;
}

std::shared_ptr<PriorScores> prior_favouring(const std::vector<std::int64_t>& positions, float weight = 1.0f) {
  auto p = std::make_shared<PriorScores>();
  p->heads = 1;
  p->length = S;
  p->values.assign(S, 0.0f);
  for (auto pos : positions) p->values[static_cast<std::size_t>(pos)] = 1.0f;
  p->weight = weight;
  return p;
}

bool holds(const CacheView& v, std::int64_t pos) {
  const auto p = sorted_positions(v);
  return std::binary_search(p.begin(), p.end(), pos);
}

TEST(PriorScores, APriorKeepsWhatTheWindowCannotSee) {
  const KV kv(1, 1, S, 8, 5);
  const auto pos = iota(S);
  const auto probs = flat_attention();
  const std::vector<std::int64_t> favoured = {5, 12, 20};
  // Without a prior the flat window keeps none of them (ties go to the lowest positions first,
  // the early rows being seen by most queries at the lowest mean).
  auto plain = KVCacheFactory::create(h2o(16));
  plain->update_and_fetch(kv.keys(), kv.values(), pos);
  plain->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  for (auto f : favoured) EXPECT_FALSE(holds(plain->view(), f)) << f;

  auto cache = KVCacheFactory::create(h2o(16));
  ASSERT_TRUE(attach_prior_scores(*cache, prior_favouring(favoured)));
  cache->reset();  // an attached prior is for the sequence that starts here
  cache->update_and_fetch(kv.keys(), kv.values(), pos);
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  EXPECT_EQ(cache->rows(), 16u);
  for (auto f : favoured) EXPECT_TRUE(holds(cache->view(), f)) << f;

  // Used by that prefill only: the next sequence's prefill ranks by its window again.
  cache->reset();
  cache->update_and_fetch(kv.keys(), kv.values(), pos);
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  EXPECT_EQ(sorted_positions(cache->view()), sorted_positions(plain->view()));
}

TEST(PriorScores, TheWindowStillCountsAtASmallWeight) {
  // The window's last queries favour position 40; the prior favours 7. At weight 1 both stay
  // (budget room for both); at weight 0 the prior changes nothing.
  const KV kv(1, 1, S, 8, 6);
  const auto pos = iota(S);
  auto probs = flat_attention();
  for (std::size_t q = S - 16; q < S; ++q) probs[q * S + 40] = 0.5f;
  auto cache = KVCacheFactory::create(h2o(16));
  ASSERT_TRUE(attach_prior_scores(*cache, prior_favouring({7}, 1.0f)));
  cache->update_and_fetch(kv.keys(), kv.values(), pos);
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  EXPECT_TRUE(holds(cache->view(), 40));
  EXPECT_TRUE(holds(cache->view(), 7));
  auto zero = KVCacheFactory::create(h2o(16));
  ASSERT_TRUE(attach_prior_scores(*zero, prior_favouring({7}, 0.0f)));
  zero->update_and_fetch(kv.keys(), kv.values(), pos);
  zero->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
  EXPECT_TRUE(holds(zero->view(), 40));
  EXPECT_FALSE(holds(zero->view(), 7));
}

TEST(PriorScores, OnlyAttentionScoredEvictionTakesOneAndBadScoresAreRefused) {
  KVCacheConfig kivi;
  kivi.method = "kivi";
  EXPECT_FALSE(attach_prior_scores(*KVCacheFactory::create(kivi), prior_favouring({1})));
  KVCacheConfig original = h2o(16);
  original.evict_profile = "original";  // key proxy: no prefill observation to rank with
  EXPECT_FALSE(attach_prior_scores(*KVCacheFactory::create(original), prior_favouring({1})));
  auto cache = KVCacheFactory::create(h2o(16));
  auto bad = prior_favouring({1});
  bad->values.pop_back();
  EXPECT_THROW(attach_prior_scores(*cache, bad), InputError);
  bad = prior_favouring({1});
  bad->values[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(attach_prior_scores(*cache, bad), InputError);
  bad = prior_favouring({1});
  bad->values[3] = -1.0f;
  EXPECT_THROW(attach_prior_scores(*cache, bad), InputError);
  EXPECT_THROW(attach_prior_scores(*cache, nullptr), InputError);
  // A prior for another number of heads is named when the prefill meets it.
  auto two = prior_favouring({1});
  two->heads = 2;
  two->length = S / 2;
  ASSERT_TRUE(attach_prior_scores(*cache, two));
  const KV kv(1, 1, S, 8, 7);
  const auto pos = iota(S);
  const auto probs = flat_attention();
  cache->update_and_fetch(kv.keys(), kv.values(), pos);
  EXPECT_THROW(cache->observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos}), InputError);
}

}  // namespace
}  // namespace kvslim
