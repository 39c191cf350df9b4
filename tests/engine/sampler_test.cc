// Sampler: greedy, determinism per seed, top-k / top-p edge cases, distribution, bad configs.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kvslim::engine {
namespace {

std::vector<int> draws(SamplerConfig cfg, const std::vector<float>& logits, int n) {
  Sampler s(cfg, static_cast<int>(logits.size()));
  std::vector<int> out;
  for (int i = 0; i < n; ++i) out.push_back(s.sample(logits));
  return out;
}

TEST(Sampler, GreedyTakesArgmaxAndLowestIdOnTies) {
  EXPECT_EQ(draws({}, {0.1f, 3.0f, -1.0f, 3.0f}, 1)[0], 1);
  EXPECT_EQ(argmax(std::vector<float>{-5, -5}), 0);
}

TEST(Sampler, SameSeedSameDrawsOtherSeedOtherDraws) {
  const std::vector<float> logits = {0.0f, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f};
  SamplerConfig cfg{.temperature = 1.0f, .seed = 7};
  const auto a = draws(cfg, logits, 64), b = draws(cfg, logits, 64);
  EXPECT_EQ(a, b);
  cfg.seed = 8;
  EXPECT_NE(a, draws(cfg, logits, 64));
}

TEST(Sampler, TopKOneIsGreedyAndTopKLimitsTheSupport) {
  const std::vector<float> logits = {1.0f, 4.0f, 3.0f, 2.0f, 0.0f};
  for (int id : draws({.temperature = 5.0f, .top_k = 1, .seed = 3}, logits, 50)) EXPECT_EQ(id, 1);
  for (int id : draws({.temperature = 50.0f, .top_k = 2, .seed = 3}, logits, 200)) {
    EXPECT_TRUE(id == 1 || id == 2) << id;
  }
  // top_k larger than the vocabulary means no limit (every token can appear at high temperature).
  std::vector<int> seen(5, 0);
  for (int id : draws({.temperature = 100.0f, .top_k = 99, .seed = 3}, logits, 500)) seen[id]++;
  for (int c : seen) EXPECT_GT(c, 0);
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities at T=1: ~0.64, 0.24, 0.09, 0.03.
  const std::vector<float> logits = {std::log(0.64f), std::log(0.24f), std::log(0.09f), std::log(0.03f)};
  for (int id : draws({.temperature = 1.0f, .top_p = 0.5f, .seed = 1}, logits, 100)) EXPECT_EQ(id, 0);
  std::vector<int> seen(4, 0);
  for (int id : draws({.temperature = 1.0f, .top_p = 0.8f, .seed = 1}, logits, 1000)) seen[id]++;
  EXPECT_GT(seen[1], 0);
  EXPECT_EQ(seen[2] + seen[3], 0);
  // Renormalised over {0, 1}: 0.64 / 0.88 = 0.727.
  EXPECT_NEAR(seen[0] / 1000.0, 0.727, 0.05);
  // A tiny top_p still keeps one token.
  for (int id : draws({.temperature = 1.0f, .top_p = 1e-6f, .seed = 2}, logits, 20)) EXPECT_EQ(id, 0);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(3.0f)};  // 1 : 3
  int ones = 0;
  const int n = 4000;
  for (int id : draws({.temperature = 1.0f, .seed = 11}, logits, n)) ones += id;
  EXPECT_NEAR(ones / static_cast<double>(n), 0.75, 0.03);
}

TEST(Sampler, RejectsBadConfigAndWrongLogitCount) {
  EXPECT_THROW(Sampler({.temperature = -1.0f}, 4), std::invalid_argument);
  EXPECT_THROW(Sampler({.top_k = -2}, 4), std::invalid_argument);
  EXPECT_THROW(Sampler({.top_p = 0.0f}, 4), std::invalid_argument);
  EXPECT_THROW(Sampler({.top_p = 1.5f}, 4), std::invalid_argument);
  EXPECT_THROW(Sampler({}, 0), std::invalid_argument);
  Sampler s({}, 4);
  EXPECT_THROW(s.sample(std::vector<float>{1, 2}), std::invalid_argument);
}

TEST(Rng, UniformStaysInUnitInterval) {
  Rng rng(0);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const float u = rng.uniform();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

}  // namespace
}  // namespace kvslim::engine
