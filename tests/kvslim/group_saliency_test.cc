// The device's choice of a zipcache group's salient rows (cuda/group_saliency.h: a rank per row,
// one thread each) against the CPU's saliency_mask, on any machine: the same rows for every group
// size up to a device group's 1024 rows, every salient count, and norms full of ties (equal keys,
// zero rows) where only the tie rule -- the later row ranks higher -- decides.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/group_saliency.h"
#include "kvslim/zipcache.h"

namespace kvslim {
namespace {

std::vector<std::uint8_t> by_rank(const std::vector<double>& norms, double fraction) {
  const int m = static_cast<int>(norms.size()), n_hi = static_cast<int>(salient_count(norms.size(), fraction));
  std::vector<std::uint8_t> mask(norms.size());
  for (int i = 0; i < m; ++i) mask[static_cast<std::size_t>(i)] = cuda::salient_by_rank(norms.data(), m, i, n_hi) ? 1 : 0;
  return mask;
}

TEST(GroupSaliency, TheDevicesRankRuleKeepsTheCpuMasksRows) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.0, 4.0);
  std::uniform_int_distribution<int> few(0, 3);
  for (const int m : {1, 2, 3, 31, 32, 33, 64, 96, 127, 128, 200, 1024}) {
    for (const double fraction : {0.0, 0.01, 0.2, 0.3, 0.5, 0.9, 0.999, 1.0}) {
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<double> norms(static_cast<std::size_t>(m));
        for (auto& n : norms) {
          n = kind == 0 ? u(rng)                            // distinct
              : kind == 1 ? static_cast<double>(few(rng))  // four values: ties everywhere
                          : 0.0;                            // every row equal (all-zero keys)
        }
        EXPECT_EQ(by_rank(norms, fraction), saliency_mask(norms, fraction))
            << "m " << m << " fraction " << fraction << " kind " << kind;
      }
    }
  }
}

}  // namespace
}  // namespace kvslim
