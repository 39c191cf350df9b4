#include "engine/eval/text_fidelity.h"

#include <gtest/gtest.h>

#include <numeric>

#include "eval_test_util.h"

namespace kvslim::engine::eval {
namespace {

using testing::kBos;
using testing::small_model;

std::vector<int> stream(std::size_t n) {
  std::vector<int> s(n);
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<int>((i * 37 + i / 7) % 250);
  return s;
}

WindowRun run_with(const KVCacheConfig& config, const TextWindow& w) {
  const Model& model = small_model();
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), config);
  ForwardOptions fo;
  fo.threads = 1;
  Transformer t(model, caches, fo);
  return run_window(t, caches, w);
}

TEST(EvalTextFidelity, WindowsAreCutInOrderWithBos) {
  const auto s = stream(1000);
  const auto w = make_windows(s, kBos, 100, 20, 3);
  ASSERT_EQ(w.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(w[i].tokens.size(), 120u);
    EXPECT_EQ(w[i].context, 100u);
    EXPECT_EQ(w[i].tokens[0], kBos);
    EXPECT_EQ(w[i].tokens[1], s[i * 119]);
  }
  EXPECT_THROW(make_windows(s, kBos, 500, 100, 3), std::invalid_argument);  // 1797 tokens needed
  EXPECT_THROW(make_windows(s, std::nullopt, 0, 10, 1), std::invalid_argument);
}

TEST(EvalTextFidelity, FullAgainstFullIsExact) {
  const auto w = make_windows(stream(400), kBos, 96, 12, 1)[0];
  KVCacheConfig full;
  full.method = "full";
  const WindowRun a = run_with(full, w), b = run_with(full, w);
  const auto t = compare_runs(w, a, b, 260);
  EXPECT_EQ(t.steps, 12u);
  EXPECT_EQ(t.kl(), 0.0);
  EXPECT_EQ(t.top1(), 1.0);
  EXPECT_DOUBLE_EQ(t.ppl(), t.ref_ppl());
  EXPECT_DOUBLE_EQ(t.level(), 1.0);
  EXPECT_GT(t.ppl(), 1.0);
}

TEST(EvalTextFidelity, TinyBudgetDiverges) {
  const auto w = make_windows(stream(400), kBos, 96, 12, 1)[0];
  KVCacheConfig full;
  full.method = "full";
  KVCacheConfig tiny;
  tiny.method = "h2o";
  tiny.h2o_budget = 8;
  const WindowRun ref = run_with(full, w), small = run_with(tiny, w);
  const auto t = compare_runs(w, ref, small, 260);
  EXPECT_GT(t.kl(), 1e-4);
  EXPECT_LT(t.level(), 0.2);
  EXPECT_NEAR(small.kept_tokens, 8.0, 1e-9);
  EXPECT_NE(t.ppl(), t.ref_ppl());
}

TEST(EvalTextFidelity, CompareRejectsMismatchedRuns) {
  const auto w = make_windows(stream(400), kBos, 96, 12, 1)[0];
  WindowRun a, b;
  a.log_probs.assign(12 * 260, -5.5f);
  b.log_probs.assign(11 * 260, -5.5f);
  EXPECT_THROW(compare_runs(w, a, b, 260), std::invalid_argument);
}

}  // namespace
}  // namespace kvslim::engine::eval
