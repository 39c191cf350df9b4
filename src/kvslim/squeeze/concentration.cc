// The SqueezeAttention-adapted concentration proxy: mean off-diagonal cosine of a key set.
#include <cmath>
#include <vector>

#include "kernels.h"
#include "kvslim/squeeze.h"

namespace kvslim {

double concentration_score(const float* rows, std::size_t n, std::size_t d) {
  if (rows == nullptr || n < 2) return 0.0;
  // sum(G) = |sum_i u_i|^2 and trace(G) = sum_i |u_i|^2, with u_i = k_i / (|k_i| + 1e-8):
  // O(n d) instead of forming the n x n Gram matrix.
  std::vector<double> direction_sum(d, 0.0);  // [d]
  double trace = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const float* k = rows + i * d;
    const double sq = static_cast<double>(kernels::dot_f32(k, k, d));
    const double inv = 1.0 / (std::sqrt(sq) + 1e-8);
    // |u_i|^2 = |k_i|^2 inv^2; the update below is then element-wise, and vectorises.
    trace += sq * inv * inv;
    double* acc = direction_sum.data();
    for (std::size_t j = 0; j < d; ++j) acc[j] += static_cast<double>(k[j]) * inv;
  }
  double total = 0.0;
  for (double s : direction_sum) total += s * s;
  return (total - trace) / (static_cast<double>(n) * static_cast<double>(n - 1));
}

}  // namespace kvslim
