// A row's attention probability as attend reports it (probs [B, Hkv, S, rows]): the softmax
// weight exp2(logit - max) / sum of each of the G query heads that share the row's KV head, summed
// over them. Written once here so that the two kernels computing it (attend's probs_kernel, and
// the eviction cache's decode observation, which computes a replayed step's probabilities itself
// instead of a separate launch) give the same bits.
#pragma once

namespace kvslim::cuda {

// logits [.., rows_total] and final_ml [.., 2] (max, sum) of query vectors vec0 .. vec0 + G - 1.
__device__ __forceinline__ float summed_probability(const float* logits, const float* final_ml, long long vec0, int G,
                                                    long long rows_total, long long row) {
  float sum = 0.f;
  for (int j = 0; j < G; ++j) {
    const long long m = vec0 + j;
    const float M = final_ml[m * 2], L = final_ml[m * 2 + 1];
    const float lg = logits[m * rows_total + row];
    if (M != -INFINITY && lg != -INFINITY && L > 0.f) sum += exp2f(lg - M) / L;
  }
  return sum;
}

}  // namespace kvslim::cuda
