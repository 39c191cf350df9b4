// Per-layer budget schedules: the data-driven squeeze split and PyramidKV's fixed taper.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kvslim/errors.h"
#include "kvslim/squeeze.h"

namespace kvslim {

namespace {

// A schedule's budget from its real-valued share, never below the floor. Shares above INT_MAX
// (avg_budget near INT_MAX, or 10^9 on a layer weighted x3) saturate at INT_MAX instead of
// wrapping to INT_MIN and then the floor: no sequence reaches 2^31 rows, so "keep INT_MAX" keeps
// exactly what the real-valued budget would.
int layer_budget(double share, int floor_budget) {
  constexpr double kMax = static_cast<double>(std::numeric_limits<int>::max());
  const double rounded = std::nearbyint(share);  // Python's round() is half-to-even: nearbyint
  const int b = rounded >= kMax ? std::numeric_limits<int>::max() : !(rounded > 0.0) ? 0 : static_cast<int>(rounded);
  return std::max(b, floor_budget);
}

// n_sink + 1 without wrapping at n_sink == INT_MAX.
int floor_of(int n_sink) {
  return n_sink >= std::numeric_limits<int>::max() ? std::numeric_limits<int>::max() : std::max(n_sink, 0) + 1;
}

}  // namespace

std::vector<int> squeeze_budgets(std::span<const double> concentrations, int avg_budget, int n_sink,
                                 double strength) {
  if (concentrations.empty()) return {};  // before the strength check, as the original
  if (!(strength >= 0.0 && strength <= 1.0)) {
    throw ConfigError("squeeze_budgets: strength = " + std::to_string(strength) + ": must be in [0, 1]");
  }
  const int floor_budget = floor_of(n_sink);
  const std::size_t L = concentrations.size();
  if (L == 1) return {std::max(avg_budget, floor_budget)};

  std::vector<double> raw(L);
  double total = 0.0;
  for (std::size_t i = 0; i < L; ++i) {
    if (std::isnan(concentrations[i])) {
      throw std::invalid_argument("squeeze_budgets: concentrations[" + std::to_string(i) + "] is NaN");
    }
    const double c = std::clamp(concentrations[i], 0.0, 1.0);
    raw[i] = 1.0 - c;
    total += raw[i];
  }
  std::vector<int> budgets(L);
  for (std::size_t i = 0; i < L; ++i) {
    const double weight = total <= 0.0 ? 1.0 : raw[i] * static_cast<double>(L) / total;
    budgets[i] = layer_budget(avg_budget * ((1.0 - strength) + strength * weight), floor_budget);
  }
  return budgets;
}

std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta) {
  if (n_layers <= 0) return {};
  if (!(beta >= 1.0)) throw ConfigError("pyramid_budgets: beta = " + std::to_string(beta) + ": must be >= 1");
  const int floor_budget = floor_of(n_sink);
  if (n_layers == 1) return {std::max(avg_budget, floor_budget)};
  // kvpress's PyramidKV: the last layer gets avg/beta, the first 2*avg - avg/beta, linear between,
  // so the mean stays avg (before the floor).
  const double min_b = avg_budget / beta;
  const double max_b = 2.0 * avg_budget - min_b;
  const double step = (max_b - min_b) / (n_layers - 1);
  std::vector<int> budgets(n_layers);
  for (int i = 0; i < n_layers; ++i) {
    budgets[i] = layer_budget(max_b - i * step, floor_budget);
  }
  return budgets;
}

}  // namespace kvslim
