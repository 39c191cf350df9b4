// Internal SIMD kernels of the library (run-time dispatched; see simd_kernels.cc).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvslim/activations.h"

namespace kvslim::kernels {

// acc[i] += softmax(scale * logits)[i] for i < n (fp32, max-subtracted). n >= 1.
// `logits` is scratch: it is overwritten with the unnormalised exponentials.
void softmax_accumulate(float* logits, std::size_t n, float scale, float* acc);

// softmax_inplace, swiglu_inplace: public (kvslim/activations.h).

// True when any of the n fp16 values is NaN or infinite.
bool fp16_has_nonfinite(const std::uint16_t* x, std::size_t n);

// sum of x[i] * y[i] and sum of x[i]^2 in double-free fp32 SIMD, used by concentration_score.
void add_f32(const float* x, std::size_t n, float* acc);  // acc[i] += x[i]
float dot_f32(const float* x, const float* y, std::size_t n);

// Many queries against transposed rows: out[b * ldo + i] = sum_j q[b * d + j] * kt[j * ld + i] for
// b < nq and i < n. kt is [d, ld] fp32 (column i = row i), q is [nq, d], out is [nq, ldo]. The
// kernel works in whole vectors: columns up to n rounded up to kColumnPad are read and written,
// so ld and ldo must be at least that (the extra outputs are meaningless; their inputs must be
// finite only to keep the arithmetic fast).
inline constexpr std::size_t kColumnPad = 64;
inline std::size_t padded_columns(std::size_t n) { return (n + kColumnPad - 1) / kColumnPad * kColumnPad; }
void dot_columns_f32(const float* kt, std::size_t ld, std::size_t n, std::size_t d, const float* q, std::size_t nq,
                     float* out, std::size_t ldo);

}  // namespace kvslim::kernels
