// Per-layer budget schedules: the data-driven squeeze split and PyramidKV's fixed taper.
#include <algorithm>
#include <cmath>
#include <string>

#include "kvslim/errors.h"
#include "kvslim/squeeze.h"

namespace kvslim {

std::vector<int> squeeze_budgets(std::span<const double> concentrations, int avg_budget, int n_sink,
                                 double strength) {
  if (concentrations.empty()) return {};  // before the strength check, as the original
  if (!(strength >= 0.0 && strength <= 1.0)) {
    throw ConfigError("squeeze_budgets: strength = " + std::to_string(strength) + ": must be in [0, 1]");
  }
  const int floor_budget = n_sink + 1;
  const std::size_t L = concentrations.size();
  if (L == 1) return {std::max(avg_budget, floor_budget)};

  std::vector<double> raw(L);
  double total = 0.0;
  for (std::size_t i = 0; i < L; ++i) {
    const double c = std::clamp(concentrations[i], 0.0, 1.0);
    raw[i] = 1.0 - c;
    total += raw[i];
  }
  std::vector<int> budgets(L);
  for (std::size_t i = 0; i < L; ++i) {
    const double weight = total <= 0.0 ? 1.0 : raw[i] * static_cast<double>(L) / total;
    const double b = avg_budget * ((1.0 - strength) + strength * weight);
    // Python's round() is half-to-even: nearbyint under the default rounding mode.
    budgets[i] = std::max(static_cast<int>(std::nearbyint(b)), floor_budget);
  }
  return budgets;
}

std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta) {
  if (n_layers <= 0) return {};
  if (!(beta >= 1.0)) throw ConfigError("pyramid_budgets: beta = " + std::to_string(beta) + ": must be >= 1");
  const int floor_budget = n_sink + 1;
  if (n_layers == 1) return {std::max(avg_budget, floor_budget)};
  // kvpress's PyramidKV: the last layer gets avg/beta, the first 2*avg - avg/beta, linear between,
  // so the mean stays avg (before the floor).
  const double min_b = avg_budget / beta;
  const double max_b = 2.0 * avg_budget - min_b;
  const double step = (max_b - min_b) / (n_layers - 1);
  std::vector<int> budgets(n_layers);
  for (int i = 0; i < n_layers; ++i) {
    budgets[i] = std::max(static_cast<int>(std::nearbyint(max_b - i * step)), floor_budget);
  }
  return budgets;
}

}  // namespace kvslim
