// Integer overflow in the budget schedules and in validate() (issue 13, item 3): a budget share
// above INT_MAX wrapped to INT_MIN and then became the floor (n_sink + 1), so the broadest layers
// got the least; n_sink + evict_recent_window overflowed in validate() and let a config through.
#include <gtest/gtest.h>

#include <climits>
#include <vector>

#include "kvslim/errors.h"
#include "kvslim/factory.h"
#include "kvslim/squeeze.h"
#include "test_util.h"

namespace kvslim {
namespace {

TEST(BudgetOverflow, SqueezeScheduleSaturatesInsteadOfWrappingToTheFloor) {
  const std::vector<double> c = {0, 0.9, 0.9, 0.9};
  const std::vector<int> b = squeeze_budgets(c, 1'000'000'000, 4, 1.0);
  // Layer 0's share is 1e9 x 4 / 1.3 = 3.08e9 > INT_MAX; the others 3.08e8 as before.
  EXPECT_EQ(b[0], INT_MAX);
  EXPECT_EQ(b[1], 307692308);
  EXPECT_EQ(b[3], 307692308);
  EXPECT_EQ(squeeze_budgets(std::vector<double>{0.5, 0.5}, INT_MAX, 4, 1.0), (std::vector<int>{INT_MAX, INT_MAX}));
}

TEST(BudgetOverflow, FloorAtIntMaxSinkDoesNotWrap) {
  const std::vector<double> c = {0.2, 0.8};
  for (int b : squeeze_budgets(c, 10, INT_MAX, 1.0)) EXPECT_EQ(b, INT_MAX);
  for (int b : pyramid_budgets(3, 10, INT_MAX, 2.0)) EXPECT_EQ(b, INT_MAX);
}

TEST(BudgetOverflow, NanConcentrationIsAnError) {
  const std::vector<double> c = {0.2, std::nan("")};
  EXPECT_THROW(squeeze_budgets(c, 64, 4, 1.0), std::invalid_argument);
}

TEST(BudgetOverflow, CoordinatorMaxPossibleBudgetSaturates) {
  EXPECT_EQ(SqueezeCoordinator(4, 600'000'000, 4, 1.0).max_possible_budget(), INT_MAX);
  EXPECT_EQ(SqueezeCoordinator(4, 100, 4, 1.0).max_possible_budget(), 400);
  EXPECT_EQ(SqueezeCoordinator(4, 10, INT_MAX, 1.0).max_possible_budget(), INT_MAX);
}

TEST(BudgetOverflow, PyramidTaperSaturatesAndStaysOrdered) {
  const std::vector<int> b = pyramid_budgets(2, INT_MAX, 4, 20.0);
  EXPECT_EQ(b[0], INT_MAX);                    // 2 x avg - avg / 20
  EXPECT_EQ(b[1], 107374182);                  // avg / 20, rounded half to even
  const std::vector<int> four = pyramid_budgets(4, INT_MAX, 4, 20.0);
  for (std::size_t i = 1; i < four.size(); ++i) EXPECT_GE(four[i - 1], four[i]) << i;
  EXPECT_GT(four[1], 5);
}

TEST(BudgetOverflow, ValidateAddsSinkAndWindowWithoutOverflow) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_n_sink = INT_MAX;
  c.evict_recent_window = 5;
  EXPECT_THROW(c.validate(), ConfigError);
  c.h2o_n_sink = 4;
  c.evict_recent_window = INT_MAX;
  EXPECT_THROW(c.validate(), ConfigError);
  c.method = "pyramidkv";
  c.evict_recent_window = 0;
  c.pyramidkv_n_sink = INT_MAX;
  EXPECT_THROW(c.validate(), ConfigError);
}

TEST(BudgetOverflow, HugeBudgetsKeepEverythingInEveryLayer) {
  // pyramidkv_budget = squeeze_budget = INT_MAX kept 5 tokens in layers 0-1 before.
  for (const char* method : {"pyramidkv", "squeeze"}) {
    SCOPED_TRACE(method);
    KVCacheConfig c = testing::config_for(method);
    c.pyramidkv_budget = INT_MAX;
    c.squeeze_budget = INT_MAX;
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(4, 2, 8), c);
    const testing::KV prompt(1, 2, 40, 8, 3);
    for (std::size_t l = 0; l < set.size(); ++l) set.at(l).update_and_fetch(prompt.keys(), prompt.values());
    for (int step = 0; step < 3; ++step) {
      const testing::KV tok(1, 2, 1, 8, 10 + step);
      for (std::size_t l = 0; l < set.size(); ++l) set.at(l).update_and_fetch(tok.keys(), tok.values());
    }
    for (std::size_t l = 0; l < set.size(); ++l) EXPECT_EQ(set.at(l).stats().tokens_kept, 43u) << "layer " << l;
  }
}

TEST(BudgetOverflow, SeedAtIntMaxWrapsPerLayer) {
  KVCacheConfig c = testing::config_for("h2o");
  c.seed = INT_MAX;
  EXPECT_NO_THROW(KVCacheBuilder::for_model(ModelSpec::uniform(3, 1, 8), c));
}

}  // namespace
}  // namespace kvslim
