// KVzip-style global top-k budgets across layers (squeeze_signal = "global_topk"): one threshold
// over the scores of every layer decides how many rows each layer keeps, so a layer whose rows
// the prompt's last queries attend strongly keeps more of them than one whose rows they ignore.
#include <algorithm>
#include <cmath>
#include <functional>

#include "kvslim/errors.h"
#include "kvslim/squeeze.h"

namespace kvslim {

std::vector<int> global_topk_budgets(const std::vector<std::vector<float>>& scores, const std::vector<std::size_t>& heads,
                                     const std::vector<std::size_t>& protected_rows, int avg_budget, int n_sink,
                                     double strength) {
  const std::size_t L = scores.size();
  if (heads.size() != L || protected_rows.size() != L) {
    throw std::invalid_argument("global_topk_budgets: scores, heads and protected_rows differ in length");
  }
  if (!(strength >= 0.0 && strength <= 1.0)) {
    throw ConfigError("squeeze strength = " + std::to_string(strength) + ": must be in [0, 1]");
  }
  // Slots the global top fills: every layer's evictable share of the average budget, all heads.
  std::size_t slots = 0;
  std::vector<float> merged;
  for (std::size_t l = 0; l < L; ++l) {
    const std::size_t p = protected_rows[l];
    slots += heads[l] * (static_cast<std::size_t>(avg_budget) > p ? static_cast<std::size_t>(avg_budget) - p : 0);
    merged.insert(merged.end(), scores[l].begin(), scores[l].end());
  }
  float threshold = -INFINITY;  // keep everything when the slots exceed the rows
  if (slots == 0) {
    threshold = INFINITY;
  } else if (slots < merged.size()) {
    std::nth_element(merged.begin(), merged.begin() + static_cast<std::ptrdiff_t>(slots - 1), merged.end(), std::greater<>());
    threshold = merged[slots - 1];
  }
  std::vector<int> budgets(L);
  for (std::size_t l = 0; l < L; ++l) {
    std::size_t above = 0;
    for (float s : scores[l]) above += s >= threshold ? 1 : 0;
    const double per_head = heads[l] > 0 ? static_cast<double>(above) / static_cast<double>(heads[l]) : 0.0;
    const double topk = static_cast<double>(protected_rows[l]) + per_head;
    const double blended = avg_budget * (1.0 - strength) + strength * topk;
    budgets[l] = std::max(static_cast<int>(std::nearbyint(blended)), n_sink + 1);
  }
  return budgets;
}

}  // namespace kvslim
