// Registered scores (src/kvslim/cache/row_scores.cc): value_norm_attention weighs each row's
// attention by the L1 norm of its value.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache/row_scores.h"
#include "kvslim/errors.h"
#include "test_util.h"

namespace kvslim {
namespace {

// Eight rows that receive the same attention; rows 3 and 5 have values 10x smaller. At a budget of
// 6 (2 sinks, no recent window) h2o by normalised attention drops by position (ties: oldest
// first), value_norm_attention drops the two small values.
std::vector<std::int64_t> kept_after_one_observation(const std::string& scoring) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = 6;
  c.h2o_n_sink = 2;
  c.evict_recent_window = 0;
  c.evict_pool_kernel = 1;
  c.evict_cross_layer = 0;
  c.evict_scoring = scoring;
  auto cache = KVCacheFactory::create(c);
  constexpr std::size_t S = 8, D = 4;
  std::vector<float> keys(S * D, 0.5f), values(S * D, 1.0f);  // [1, 1, S, D]
  for (std::size_t d = 0; d < D; ++d) values[3 * D + d] = values[5 * D + d] = 0.1f;
  std::vector<std::int64_t> pos(S);
  for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
  cache->append(make_block(keys.data(), 1, 1, S, D), make_block(values.data(), 1, 1, S, D), pos);
  std::vector<float> probs(2 * S, 0.0f);  // two queries after every row, uniform: [1, 1, 2, S]
  for (auto& p : probs) p = 1.0f / S;
  const std::vector<std::int64_t> q{100, 101};
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 2, S, S, q});
  return testing::sorted_positions(cache->materialize());
}

TEST(RowScores, ValueNormAttentionDropsTheRowsWithSmallValues) {
  EXPECT_EQ(kept_after_one_observation("value_norm_attention"), (std::vector<std::int64_t>{0, 1, 2, 4, 6, 7}));
  EXPECT_EQ(kept_after_one_observation("attention_normalized"), (std::vector<std::int64_t>{0, 1, 4, 5, 6, 7}));
}

TEST(RowScores, RegisteredScoresAreConfigValues) {
  ASSERT_NE(find_row_score("value_norm_attention"), nullptr);
  EXPECT_EQ(find_row_score("key_norm_typo"), nullptr);
  KVCacheConfig c;
  c.evict_scoring = "value_norm_attention";
  EXPECT_NO_THROW(c.validate());
  c.evict_scoring = "value_norm";
  try {
    c.validate();
    ADD_FAILURE() << "an unknown score was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("value_norm_attention"), std::string::npos) << e.what();  // the list names it
  }
}

}  // namespace
}  // namespace kvslim
