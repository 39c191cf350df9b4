#include "engine/eval/bootstrap.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvslim::engine::eval {

Interval bootstrap(std::size_t n, const std::function<double(std::span<const std::uint32_t>)>& statistic,
                   std::uint64_t seed, std::size_t resamples) {
  if (n == 0 || resamples == 0) return {};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> pick(0, n - 1);
  std::vector<std::uint32_t> counts(n);
  std::vector<double> stats;
  stats.reserve(resamples);
  for (std::size_t r = 0; r < resamples; ++r) {
    std::fill(counts.begin(), counts.end(), 0u);
    for (std::size_t i = 0; i < n; ++i) ++counts[pick(rng)];
    const double s = statistic(counts);
    if (std::isfinite(s)) stats.push_back(s);
  }
  if (stats.empty()) return {};
  std::sort(stats.begin(), stats.end());
  auto at = [&](double q) {
    const double x = q * static_cast<double>(stats.size() - 1);
    const std::size_t i = static_cast<std::size_t>(std::floor(x));
    const double f = x - static_cast<double>(i);
    return i + 1 < stats.size() ? stats[i] * (1 - f) + stats[i + 1] * f : stats[i];
  };
  return {at(0.025), at(0.975)};
}

Interval text_interval(std::span<const FidelityTotals> windows, TextFigure figure) {
  return bootstrap(windows.size(), [&](std::span<const std::uint32_t> counts) {
    FidelityTotals t;
    for (std::size_t i = 0; i < windows.size(); ++i) {
      for (std::uint32_t c = 0; c < counts[i]; ++c) t.add(windows[i]);
    }
    switch (figure) {
      case TextFigure::kl: return t.kl();
      case TextFigure::top1: return t.top1();
      case TextFigure::delta_ppl: return t.ppl() - t.ref_ppl();
    }
    return 0.0;
  });
}

Interval accuracy_interval(std::span<const char> outcomes) {
  return bootstrap(outcomes.size(), [&](std::span<const std::uint32_t> counts) {
    double correct = 0, total = 0;
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
      correct += outcomes[i] ? counts[i] : 0;
      total += counts[i];
    }
    return total > 0 ? correct / total : 0.0;
  });
}

}  // namespace kvslim::engine::eval
