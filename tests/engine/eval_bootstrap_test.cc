#include "engine/eval/bootstrap.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvslim::engine::eval {
namespace {

FidelityTotals window(double kl_per_step, std::size_t steps, std::size_t agree) {
  FidelityTotals t;
  t.kl_sum = kl_per_step * static_cast<double>(steps);
  t.steps = steps;
  t.top1_agree = agree;
  t.windows = 1;
  return t;
}

TEST(EvalBootstrap, IntervalHoldsTheEstimateAndShrinksWithMoreUnits) {
  std::vector<char> few = {1, 0, 1, 1, 0, 1, 0, 1};
  std::vector<char> many;
  for (int r = 0; r < 10; ++r) many.insert(many.end(), few.begin(), few.end());
  const Interval a = accuracy_interval(few), b = accuracy_interval(many);
  EXPECT_LE(a.lo, 0.625);
  EXPECT_GE(a.hi, 0.625);
  EXPECT_LE(b.lo, 0.625);
  EXPECT_GE(b.hi, 0.625);
  EXPECT_LT(b.hi - b.lo, a.hi - a.lo);
  EXPECT_GT(a.hi - a.lo, 0.2);  // 8 episodes say little
  // Deterministic: the same units give the same interval.
  const Interval again = accuracy_interval(few);
  EXPECT_EQ(a.lo, again.lo);
  EXPECT_EQ(a.hi, again.hi);
}

TEST(EvalBootstrap, IdenticalUnitsGiveAPointAndTextFiguresPoolSteps) {
  const std::vector<char> all_right(20, 1);
  const Interval p = accuracy_interval(all_right);
  EXPECT_EQ(p.lo, 1.0);
  EXPECT_EQ(p.hi, 1.0);
  // KL pooled over steps: windows of 0.1 and 0.3 nats per step.
  std::vector<FidelityTotals> w = {window(0.1, 100, 90), window(0.3, 100, 70), window(0.1, 100, 90), window(0.3, 100, 70)};
  const Interval kl = text_interval(w, TextFigure::kl);
  EXPECT_GE(kl.lo, 0.1 - 1e-12);
  EXPECT_LE(kl.hi, 0.3 + 1e-12);
  EXPECT_LT(kl.lo, 0.2);
  EXPECT_GT(kl.hi, 0.2);
  const Interval top1 = text_interval(w, TextFigure::top1);
  EXPECT_GE(top1.lo, 0.7 - 1e-12);
  EXPECT_LE(top1.hi, 0.9 + 1e-12);
  EXPECT_TRUE(kl.overlaps(Interval{0.25, 0.5}));
  EXPECT_FALSE(kl.overlaps(Interval{0.31, 0.5}));
  EXPECT_EQ(text_interval({}, TextFigure::kl).hi, 0.0);  // no windows: empty interval
}

}  // namespace
}  // namespace kvslim::engine::eval
