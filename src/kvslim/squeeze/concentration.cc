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
    const double norm = std::sqrt(static_cast<double>(kernels::dot_f32(k, k, d)));
    const double inv = 1.0 / (norm + 1e-8);
    double self = 0.0;
    for (std::size_t j = 0; j < d; ++j) {
      const double u = k[j] * inv;
      direction_sum[j] += u;
      self += u * u;
    }
    trace += self;
  }
  double total = 0.0;
  for (double s : direction_sum) total += s * s;
  return (total - trace) / (static_cast<double>(n) * static_cast<double>(n - 1));
}

}  // namespace kvslim
