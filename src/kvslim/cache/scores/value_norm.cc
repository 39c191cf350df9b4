// value_norm_attention: a row's attention weighted by the L1 norm of its value (VATP, Guo et al.
// 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction":
// a row's contribution to the output is its weight times its value, so a heavily attended row with
// a near-zero value (attention sinks often are) matters less than its attention says).
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvslim/dtype.h"

namespace kvslim::scores {

float value_norm_weight(const std::uint16_t* /*key*/, const std::uint16_t* value, std::size_t dim) {
  double sum = 0;
  for (std::size_t d = 0; d < dim; ++d) sum += std::fabs(fp16_to_f32(value[d]));
  return static_cast<float>(sum);
}

}  // namespace kvslim::scores
