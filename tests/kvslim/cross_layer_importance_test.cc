// Cross-layer importance (evict_cross_layer): the layers of one model share what their prefill
// queries attended, so a layer keeps a token that another layer's queries needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cache/cross_layer_importance.h"
#include "cache/eviction_core.h"
#include "kvslim/factory.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::sorted_positions;

TEST(CrossLayerImportance, ReadsTheLargestValueOfEveryOtherLayer) {
  CrossLayerImportance board(3);
  ASSERT_TRUE(board.join(0, 0));
  const std::vector<std::int64_t> pos = {2, 5, 9};
  board.post(0, 0, pos.data(), std::vector<float>{0.5f, 0.1f, 0.0f}.data(), 3);
  board.leave(0);  // a layer's posts join the board when it leaves
  ASSERT_TRUE(board.join(1, 0));
  board.post(1, 0, pos.data(), std::vector<float>{0.2f, 0.3f, 0.7f}.data(), 3);
  board.post(1, 0, pos.data(), std::vector<float>{0.6f, 0.0f, 0.0f}.data(), 3);  // a second KV head of layer 1
  board.leave(1);
  std::vector<float> out(4);
  const std::vector<std::int64_t> ask = {1, 2, 5, 9};
  board.read(0, 0, ask.data(), 4, out.data());  // layer 0 sees layer 1 only
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.6f, 0.3f, 0.7f}));
  board.read(1, 0, ask.data(), 4, out.data());  // layer 1 sees layer 0 only
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.5f, 0.1f, 0.0f}));
  board.read(2, 0, ask.data(), 4, out.data());  // layer 2 sees both
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.6f, 0.3f, 0.7f}));
  board.read(2, 1, ask.data(), 4, out.data());  // another batch row: nothing posted
  EXPECT_EQ(out, (std::vector<float>(4, 0.0f)));
}

TEST(CrossLayerImportance, PostsAreSeenOnceTheLayerLeavesAndDroppedWhenItFailed) {
  CrossLayerImportance board(3);
  const std::vector<std::int64_t> pos = {3, 4};
  std::vector<float> out(2);
  ASSERT_TRUE(board.join(0, 0));
  board.post(0, 0, pos.data(), std::vector<float>{0.4f, 0.8f}.data(), 2);
  board.read(1, 0, pos.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>(2, 0.0f)));  // still pending
  board.leave(0);
  board.read(1, 0, pos.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.4f, 0.8f}));
  ASSERT_TRUE(board.join(1, 0));
  board.post(1, 0, pos.data(), std::vector<float>{0.9f, 0.9f}.data(), 2);
  board.leave(1, /*publish=*/false);  // its observation threw: nothing of it is kept
  board.read(2, 0, pos.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.4f, 0.8f}));
}

TEST(CrossLayerImportance, EachPrefillCallStartsEmptyAndEndsReleased) {
  CrossLayerImportance board(2);
  const std::vector<std::int64_t> pos = {0, 1};
  const std::vector<float> v = {1.0f, 1.0f};
  ASSERT_TRUE(board.join(0, 0));
  board.post(0, 0, pos.data(), v.data(), 2);
  board.leave(0);
  EXPECT_GT(board.bytes(), 0u);
  ASSERT_TRUE(board.join(1, 0));
  board.leave(1);
  EXPECT_EQ(board.bytes(), 0u);  // every layer left: nothing held between calls
  // The next call does not see the last one's values; a layer that lags behind is refused.
  ASSERT_TRUE(board.join(0, 1));
  board.post(0, 0, pos.data(), v.data(), 2);
  ASSERT_TRUE(board.join(1, 2));
  std::vector<float> out(2);
  board.read(1, 0, pos.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>(2, 0.0f)));
  EXPECT_FALSE(board.join(0, 1));
  board.reset();
  EXPECT_TRUE(board.join(0, 0));
  EXPECT_EQ(board.bytes(), 0u);
}

// Two layers, one prefill: layer 0's last queries attend token 20; layer 1's never do. Scoring
// alone, layer 1 drops token 20; with the board it keeps it, and the budget still holds.
TEST(CrossLayerImportance, ALayerKeepsWhatAnotherLayersQueriesNeeded) {
  const std::size_t S = 64, D = 8;
  for (double weight : {0.0, 1.0}) {
    KVCacheConfig c;
    c.method = "h2o";
    c.h2o_budget = 16;
    c.h2o_n_sink = 2;
    c.evict_pool_kernel = 1;
    c.evict_cross_layer = weight;
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 1, D), c);
    std::vector<std::int64_t> pos(S);
    for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
    for (std::size_t layer = 0; layer < 2; ++layer) {
      KV kv(1, 1, S, D, 7 + static_cast<unsigned>(layer));
      set.at(layer).append(kv.keys(), kv.values(), pos);
      // Causal attention of every query: a little everywhere, decreasing with position (so the
      // early rows win when nothing else counts), and in layer 0 a lot on token 20.
      std::vector<float> probs(S * S, 0.0f);
      for (std::size_t q = 0; q < S; ++q) {
        for (std::size_t i = 0; i <= q; ++i) probs[q * S + i] = 0.001f * static_cast<float>(S - i);
        if (layer == 0 && q >= 20) probs[q * S + 20] = 0.5f;
      }
      set.at(layer).observe_attention(AttentionObservation{probs.data(), 1, 1, S, S, S, pos});
    }
    for (std::size_t layer = 0; layer < 2; ++layer) {
      const auto kept = sorted_positions(set.at(layer).materialize());
      EXPECT_EQ(kept.size(), 16u);
      const bool has20 = std::binary_search(kept.begin(), kept.end(), 20);
      EXPECT_EQ(has20, layer == 0 || weight > 0.0) << "layer " << layer << " weight " << weight;
    }
  }
}

TEST(CrossLayerImportance, OnByDefaultOffInTheOriginalProfile) {
  EXPECT_EQ(make_eviction_policy(KVCacheConfig{}, 4).cross_layer, 0.1f);
  KVCacheConfig o;
  o.evict_profile = "original";
  EXPECT_EQ(make_eviction_policy(o, 4).cross_layer, 0.0f);
  o.evict_cross_layer = 0.5;
  EXPECT_EQ(make_eviction_policy(o, 4).cross_layer, 0.5f);
  KVCacheConfig bad;
  bad.evict_cross_layer = -0.5;
  EXPECT_THROW(bad.validate(), ConfigError);
}

}  // namespace
}  // namespace kvslim
