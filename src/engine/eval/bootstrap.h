// 95 % bootstrap intervals for `kvslim eval`'s figures: resample the independent units (text
// windows, retrieval episodes) with replacement, recompute the figure, take the 2.5 / 97.5 %
// percentiles. Deterministic for a given seed, so a table is reproducible.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/eval/text_fidelity.h"

namespace kvslim::engine::eval {

struct Interval {
  double lo = 0, hi = 0;
  bool overlaps(const Interval& o) const { return lo <= o.hi && o.lo <= hi; }
};

constexpr std::size_t kBootstrapResamples = 2000;

// The percentile interval of `statistic` over `resamples` resamples of the units 0..n-1; the
// statistic gets how many times each unit was drawn ([n] counts). n == 0 gives {0, 0}.
Interval bootstrap(std::size_t n, const std::function<double(std::span<const std::uint32_t>)>& statistic,
                   std::uint64_t seed = 12345, std::size_t resamples = kBootstrapResamples);

// Over text windows: mean KL, top-1 agreement and the perplexity change of the pooled steps.
enum class TextFigure { kl, top1, delta_ppl };
Interval text_interval(std::span<const FidelityTotals> windows, TextFigure figure);
// Over episodes: exact-match accuracy.
Interval accuracy_interval(std::span<const char> outcomes);

}  // namespace kvslim::engine::eval
