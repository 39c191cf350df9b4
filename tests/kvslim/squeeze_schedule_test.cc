// The squeeze concentration proxy, budget schedule and coordinator (seed Evidence: "Concentration
// proxy", "Allocator", "Coordinator"; original tests test_squeeze.py 1-19 and
// test_squeeze_cache.py 7-11; golden values of seed-behaviour.md §3.2).
#include <gtest/gtest.h>

#include <numeric>

#include "kvslim/errors.h"
#include "kvslim/squeeze.h"
#include "test_util.h"

namespace kvslim {
namespace {

double conc(const std::vector<float>& rows, std::size_t d) { return concentration_score(rows.data(), rows.size() / d, d); }

TEST(Concentration, IdenticalKeysScoreOne) {
  EXPECT_NEAR(conc(std::vector<float>(6 * 8, 1.0f), 8), 1.0, 1e-4);
}

TEST(Concentration, OrthogonalKeysScoreZero) {
  std::vector<float> eye(6 * 8, 0.0f);
  for (int i = 0; i < 6; ++i) eye[i * 8 + i] = 1.0f;
  EXPECT_NEAR(conc(eye, 8), 0.0, 1e-4);
}

TEST(Concentration, ScaleInvariant) {
  auto rows = testing::normal_fp16(10 * 8, 1);
  auto scaled = rows;
  for (auto& x : scaled) x *= 100.0f;
  EXPECT_NEAR(conc(rows, 8), conc(scaled, 8), 1e-4);
}

TEST(Concentration, FewerThanTwoRowsIsNeutral) {
  EXPECT_EQ(concentration_score(nullptr, 0, 8), 0.0);
  const std::vector<float> one(8, 1.0f);
  EXPECT_EQ(concentration_score(one.data(), 1, 8), 0.0);
  EXPECT_EQ(concentration_score(nullptr, 5, 8), 0.0);
}

TEST(Concentration, AlwaysInMinusOneToOne) {
  for (unsigned seed = 0; seed < 5; ++seed) {
    const double c = conc(testing::normal_fp16(12 * 16, seed), 16);
    EXPECT_GE(c, -1.0);
    EXPECT_LE(c, 1.0);
  }
  // Two opposite keys: exactly -1.
  EXPECT_NEAR(conc({1, 0, -1, 0}, 2), -1.0, 1e-6);
}

TEST(Concentration, MatchesPairwiseDefinition) {
  const std::size_t n = 17, d = 12;
  auto rows = testing::normal_fp16(n * d, 9);
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      double ab = 0, aa = 0, bb = 0;
      for (std::size_t k = 0; k < d; ++k) {
        ab += rows[i * d + k] * rows[j * d + k];
        aa += rows[i * d + k] * rows[i * d + k];
        bb += rows[j * d + k] * rows[j * d + k];
      }
      sum += ab / (std::sqrt(aa) * std::sqrt(bb));
    }
  }
  EXPECT_NEAR(conc(rows, d), sum / (n * (n - 1)), 1e-6);
}

std::vector<int> budgets(std::vector<double> c, int avg, int sink = 4, double s = 1.0) {
  return squeeze_budgets(c, avg, sink, s);
}

TEST(SqueezeBudgets, GoldenValuesFromTheOriginal) {
  EXPECT_EQ(budgets({0.1, 0.5, 0.9}, 100), (std::vector<int>{180, 100, 20}));  // the seed's example
  EXPECT_EQ(budgets({0.1, 0.9}, 100, 4, 0.0), (std::vector<int>{100, 100}));
  EXPECT_EQ(budgets({0.1, 0.9}, 100, 4, 0.5), (std::vector<int>{140, 60}));
  EXPECT_EQ(budgets({0.1, 0.9}, 100, 4, 1.0), (std::vector<int>{180, 20}));
  EXPECT_EQ(budgets({0.0, 1, 1, 1}, 50, 8), (std::vector<int>{200, 9, 9, 9}));
  EXPECT_EQ(budgets({-0.5, 0.9}, 100), (std::vector<int>{182, 18}));
  EXPECT_EQ(budgets({0.1, 0.3, 0.5, 0.7, 0.9}, 200), (std::vector<int>{360, 280, 200, 120, 40}));
  EXPECT_EQ(budgets({0.05, 0.25, 0.5, 0.75, 0.95}, 300), (std::vector<int>{570, 450, 300, 150, 30}));
  EXPECT_EQ(budgets({1, 1, 1}, 64), (std::vector<int>{64, 64, 64}));
}

TEST(SqueezeBudgets, RoundsHalfToEvenLikePython) {
  EXPECT_EQ(budgets({0.25, 0.75}, 10, 4, 0.5), (std::vector<int>{12, 8}));  // 12.5 -> 12, std::round gives 13
}

TEST(SqueezeBudgets, LengthMatchesLayers) { EXPECT_EQ(budgets({0.1, 0.2, 0.3, 0.4}, 64).size(), 4u); }

TEST(SqueezeBudgets, StrengthZeroIsUniformRegardlessOfConcentration) {
  EXPECT_EQ(budgets({0.1, 0.9, 0.5, 0.0, 1.0}, 256, 4, 0.0), std::vector<int>(5, 256));
  EXPECT_EQ(budgets({0, 0, 0}, 128, 4, 0.0), std::vector<int>(3, 128));
  EXPECT_EQ(budgets({0.3, 0.7, 0.99}, 128, 4, 0.0), std::vector<int>(3, 128));
}

TEST(SqueezeBudgets, MeanPreservedAtFullStrength) {
  const auto b = budgets({0.1, 0.3, 0.5, 0.7, 0.9}, 200);
  const double mean = std::accumulate(b.begin(), b.end(), 0.0) / b.size();
  EXPECT_LE(std::abs(mean - 200.0), 200 * 0.05);  // the seed: within 5%
  EXPECT_EQ(mean, 200.0);                          // and here exactly
}

TEST(SqueezeBudgets, BroadLayerGetsMoreThanConcentrated) {
  const auto b = budgets({0.1, 0.9}, 100);
  EXPECT_GT(b[0], b[1]);
}

TEST(SqueezeBudgets, MonotoneInConcentration) {
  const auto b = budgets({0.05, 0.25, 0.5, 0.75, 0.95}, 300);
  for (std::size_t i = 1; i < b.size(); ++i) EXPECT_GE(b[i - 1], b[i]);
}

TEST(SqueezeBudgets, FlooredAtSinkPlusOne) {
  const auto b = budgets({0, 1, 1, 1}, 50, 8);
  EXPECT_GE(*std::min_element(b.begin(), b.end()), 9);
}

TEST(SqueezeBudgets, AllConcentratedFallsBackToUniform) { EXPECT_EQ(budgets({1, 1, 1}, 64), std::vector<int>(3, 64)); }

TEST(SqueezeBudgets, NegativeConcentrationClampsToZero) {
  const auto b = budgets({-0.5, 0.9}, 100);
  EXPECT_GT(b[0], b[1]);
  EXPECT_EQ(b, budgets({0.0, 0.9}, 100));
}

TEST(SqueezeBudgets, IntermediateStrengthInterpolates) {
  const auto uniform = budgets({0.1, 0.9}, 100, 4, 0.0), half = budgets({0.1, 0.9}, 100, 4, 0.5),
             full = budgets({0.1, 0.9}, 100, 4, 1.0);
  for (int i = 0; i < 2; ++i) {
    EXPECT_GE(half[i], std::min(uniform[i], full[i]));
    EXPECT_LE(half[i], std::max(uniform[i], full[i]));
  }
  EXPECT_NE(half, uniform);
  EXPECT_NE(half, full);
}

TEST(SqueezeBudgets, SingleLayerIgnoresConcentrationAndFloors) {
  EXPECT_EQ(budgets({0.5}, 100), std::vector<int>{100});
  EXPECT_EQ(budgets({0.9}, 2, 8), std::vector<int>{9});
}

TEST(SqueezeBudgets, EmptyInputGivesEmptyEvenWithBadStrength) {
  EXPECT_TRUE(budgets({}, 100).empty());
  EXPECT_TRUE(budgets({}, 100, 4, 5.0).empty());
}

TEST(SqueezeBudgets, StrengthOutOfRangeThrows) {
  EXPECT_THROW(budgets({0.1, 0.9}, 100, 4, 1.5), ConfigError);
  EXPECT_THROW(budgets({0.1, 0.9}, 100, 4, -0.1), ConfigError);
  EXPECT_THROW(budgets({0.1, 0.9}, 100, 4, std::nan("")), ConfigError);
  EXPECT_THROW(budgets({0.1, 0.9}, 100, 4, 1.5), std::invalid_argument);  // ConfigError is an invalid_argument
}

TEST(PyramidBudgets, LinearTaperWithMeanAtAverage) {
  const auto b = pyramid_budgets(8, 128, 4, 20.0);
  ASSERT_EQ(b.size(), 8u);
  for (std::size_t i = 1; i < b.size(); ++i) EXPECT_GT(b[i - 1], b[i]);
  EXPECT_NEAR(std::accumulate(b.begin(), b.end(), 0.0) / 8, 128.0, 1.0);
  EXPECT_EQ(b.back(), 6);  // 128/20 = 6.4
  EXPECT_EQ(pyramid_budgets(1, 64, 4, 20.0), std::vector<int>{64});
}

TEST(Coordinator, NotFinalizedUntilAllLayersReport) {
  SqueezeCoordinator c(3, 100, 4, 1.0);
  c.report_concentration(0, 0.1);
  EXPECT_FALSE(c.is_finalized());
  EXPECT_FALSE(c.resolved_budget(0).has_value());
  c.report_concentration(1, 0.5);
  EXPECT_FALSE(c.is_finalized());
  c.report_concentration(2, 0.9);
  EXPECT_TRUE(c.is_finalized());
  EXPECT_EQ(*c.resolved_budget(0), 180);
  EXPECT_EQ(*c.resolved_budget(2), 20);
}

TEST(Coordinator, ResolvesBroadToMoreConcentratedToLess) {
  SqueezeCoordinator c(3, 64, 4, 1.0);
  c.report_concentration(2, 0.9);  // report order does not matter: ids are sorted
  c.report_concentration(0, 0.1);
  c.report_concentration(1, 0.5);
  EXPECT_GT(*c.resolved_budget(0), *c.resolved_budget(2));
}

TEST(Coordinator, FirstReportWinsAndLateReportsAreIgnored) {
  SqueezeCoordinator c(2, 100, 4, 1.0);
  c.report_concentration(0, 0.1);
  c.report_concentration(0, 0.99);  // second report of the same layer: ignored
  c.report_concentration(1, 0.9);
  const int before = *c.resolved_budget(0);
  c.report_concentration(0, 0.99);
  EXPECT_EQ(*c.resolved_budget(0), before);
  EXPECT_EQ(*c.concentration(0), 0.1);
}

TEST(Coordinator, StrengthZeroIsUniform) {
  SqueezeCoordinator c(4, 128, 4, 0.0);
  for (int i = 0; i < 4; ++i) c.report_concentration(i, 0.2 * i);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(*c.resolved_budget(i), 128);
}

TEST(Coordinator, ResetClearsEverything) {
  SqueezeCoordinator c(1, 100, 4, 1.0);
  c.report_concentration(0, 0.5);
  ASSERT_TRUE(c.is_finalized());
  c.reset();
  EXPECT_FALSE(c.is_finalized());
  EXPECT_FALSE(c.resolved_budget(0).has_value());
  EXPECT_FALSE(c.concentration(0).has_value());
}

TEST(Coordinator, UnknownLayerStaysUnresolvedAndListenerHearsEveryLayer) {
  SqueezeCoordinator c(2, 100, 4, 1.0);
  std::vector<std::pair<int, int>> heard;
  c.set_listener([&](int id, int b) { heard.emplace_back(id, b); });
  c.report_concentration(5, 0.1);
  c.report_concentration(7, 0.9);
  EXPECT_FALSE(c.resolved_budget(6).has_value());
  EXPECT_EQ(heard, (std::vector<std::pair<int, int>>{{5, 180}, {7, 20}}));
}

TEST(Coordinator, MaxPossibleBudgetBoundsEverySchedule) {
  SqueezeCoordinator c(4, 100, 4, 0.5);
  EXPECT_EQ(c.max_possible_budget(), 250);  // 100 * (0.5 + 0.5 * 4)
  const auto b = squeeze_budgets(std::vector<double>{0.0, 1, 1, 1}, 100, 4, 0.5);
  EXPECT_LE(*std::max_element(b.begin(), b.end()), c.max_possible_budget());
}

TEST(GlobalTopk, OneThresholdOverEveryLayer) {
  // avg 6, 2 protected rows per head: 2 layers x 1 head x 4 slots = the top 8 of all scores.
  const std::vector<std::vector<float>> scores = {{0.9f, 0.8f, 0.7f, 0.6f, 0.5f, 0.4f}, {0.1f, 0.05f, 0.3f, 0.2f}};
  EXPECT_EQ(global_topk_budgets(scores, {1, 1}, {2, 2}, 6, 1, 1.0), (std::vector<int>{8, 4}));
  EXPECT_EQ(global_topk_budgets(scores, {1, 1}, {2, 2}, 6, 1, 0.5), (std::vector<int>{7, 5}));
  EXPECT_EQ(global_topk_budgets(scores, {1, 1}, {2, 2}, 6, 1, 0.0), (std::vector<int>{6, 6}));
  // Two heads per layer: counts are per head.
  EXPECT_EQ(global_topk_budgets({{0.9f, 0.8f, 0.1f, 0.1f}, {0.5f, 0.4f, 0.3f, 0.2f}}, {2, 2}, {1, 1}, 2, 0, 1.0),
            (std::vector<int>{2, 2}));
  // More slots than rows: every layer keeps all it has; the floor holds.
  EXPECT_EQ(global_topk_budgets({{0.5f}, {}}, {1, 1}, {1, 1}, 10, 0, 1.0), (std::vector<int>{2, 1}));
  EXPECT_EQ(global_topk_budgets({{0.5f}, {}}, {1, 1}, {1, 1}, 10, 3, 1.0), (std::vector<int>{4, 4}));
  EXPECT_THROW(global_topk_budgets(scores, {1}, {2, 2}, 6, 1, 1.0), std::invalid_argument);
  EXPECT_THROW(global_topk_budgets(scores, {1, 1}, {2, 2}, 6, 1, 1.5), ConfigError);
}

TEST(GlobalTopk, CoordinatorFinalisesOnTheLastLayersScores) {
  SqueezeCoordinator c(2, 6, 1, 1.0);
  std::vector<std::pair<int, int>> heard;
  c.set_listener([&](int id, int b) { heard.emplace_back(id, b); });
  c.report_scores(0, {0.9f, 0.8f, 0.7f, 0.6f, 0.5f, 0.4f}, 1, 2);
  EXPECT_FALSE(c.is_finalized());
  c.report_scores(1, {0.1f, 0.05f, 0.3f, 0.2f}, 1, 2);
  ASSERT_TRUE(c.is_finalized());
  EXPECT_EQ(heard, (std::vector<std::pair<int, int>>{{0, 8}, {1, 4}}));
  EXPECT_NEAR(*c.concentration(0), 1.0 - 8.0 / 12.0, 1e-12);
  c.reset();
  EXPECT_FALSE(c.is_finalized());
}

}  // namespace
}  // namespace kvslim
