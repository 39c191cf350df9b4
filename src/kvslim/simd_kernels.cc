// SIMD kernels compiled for every x86 target Highway knows (SSE4, AVX2, AVX-512) and chosen at
// run time (HWY_DYNAMIC_DISPATCH): the build stays portable and this machine still gets AVX-512.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attend/attend_kernels.h"
#include "kvslim/convert.h"
#include "kvslim/dtype.h"
#include "kernels.h"

HWY_BEFORE_NAMESPACE();
namespace kvslim {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Targets whose f32->f16 demotion rounds to nearest even (F16C). Older ones truncate, so they
// use the scalar converter instead.
#undef KVSLIM_F16_DEMOTE_ROUNDS
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3 || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
#define KVSLIM_F16_DEMOTE_ROUNDS 0
#else
#define KVSLIM_F16_DEMOTE_ROUNDS 1
#endif

void ConvertFp16ToF32(const std::uint16_t* src, float* dst, std::size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const std::size_t L = hn::Lanes(df);
  const auto* h = reinterpret_cast<const hwy::float16_t*>(src);
  std::size_t i = 0;
  for (; i + L <= n; i += L) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, h + i)), df, dst + i);
  for (; i < n; ++i) dst[i] = fp16_to_f32(src[i]);
}

void ConvertBf16ToF32(const std::uint16_t* src, float* dst, std::size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du32;
  const hn::Rebind<std::uint16_t, decltype(df)> du16;
  const std::size_t L = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    const auto wide = hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src + i)));
    hn::StoreU(hn::BitCast(df, wide), df, dst + i);
  }
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

void ConvertF32ToFp16(const float* src, std::uint16_t* dst, std::size_t n) {
  std::size_t i = 0;
#if KVSLIM_F16_DEMOTE_ROUNDS
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const std::size_t L = hn::Lanes(df);
  auto* h = reinterpret_cast<hwy::float16_t*>(dst);
  for (; i + L <= n; i += L) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + i)), dh, h + i);
#endif
  for (; i < n; ++i) dst[i] = f32_to_fp16(src[i]);
}

void DotFp16Rows(const std::uint16_t* rows, std::size_t n, std::size_t d, std::size_t stride,
                 const float* q, float* out) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const std::size_t L = hn::Lanes(df);
  for (std::size_t r = 0; r < n; ++r) {
    const auto* row = reinterpret_cast<const hwy::float16_t*>(rows + r * stride);
    auto acc0 = hn::Zero(df);
    auto acc1 = hn::Zero(df);
    std::size_t j = 0;
    for (; j + 2 * L <= d; j += 2 * L) {
      acc0 = hn::MulAdd(hn::PromoteTo(df, hn::LoadU(dh, row + j)), hn::LoadU(df, q + j), acc0);
      acc1 = hn::MulAdd(hn::PromoteTo(df, hn::LoadU(dh, row + j + L)), hn::LoadU(df, q + j + L), acc1);
    }
    for (; j + L <= d; j += L) {
      acc0 = hn::MulAdd(hn::PromoteTo(df, hn::LoadU(dh, row + j)), hn::LoadU(df, q + j), acc0);
    }
    float s = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0, acc1)));
    for (; j < d; ++j) s += fp16_to_f32(rows[r * stride + j]) * q[j];
    out[r] = s;
  }
}

void AxpyFp16Row(float w, const std::uint16_t* row, std::size_t d, float* out) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const std::size_t L = hn::Lanes(df);
  const auto* h = reinterpret_cast<const hwy::float16_t*>(row);
  const auto vw = hn::Set(df, w);
  std::size_t j = 0;
  for (; j + L <= d; j += L) {
    hn::StoreU(hn::MulAdd(vw, hn::PromoteTo(df, hn::LoadU(dh, h + j)), hn::LoadU(df, out + j)), df, out + j);
  }
  for (; j < d; ++j) out[j] += w * fp16_to_f32(row[j]);
}

// Two passes: max, then exp and sum; the exponentials overwrite the caller's logits scratch and
// are added into `acc` once the sum is known.
void SoftmaxAccumulate(float* logits, std::size_t n, float scale, float* acc) {
  // The tail (n % L values) is copied into vector-sized buffers and goes through the same vector
  // code: a scalar exp per leftover value cost more than the vectors (n grows by one per token
  // during a prefill). (Highway's MaskedLoad may read the whole vector on some targets.)
  const hn::ScalableTag<float> df;
  const std::size_t L = hn::Lanes(df);
  const std::size_t full = n / L * L, rest = n - full;
  alignas(HWY_MAX_BYTES) float tail_logits[HWY_MAX_BYTES / sizeof(float)] = {};
  alignas(HWY_MAX_BYTES) float tail_acc[HWY_MAX_BYTES / sizeof(float)] = {};
  std::copy_n(logits + full, rest, tail_logits);
  const auto keep = hn::FirstN(df, rest);
  const auto ninf = hn::Set(df, -INFINITY);
  auto vmax = ninf;
  for (std::size_t i = 0; i < full; i += L) vmax = hn::Max(vmax, hn::LoadU(df, logits + i));
  if (rest != 0) vmax = hn::Max(vmax, hn::IfThenElse(keep, hn::Load(df, tail_logits), ninf));
  const float mx = hn::GetLane(hn::MaxOfLanes(df, vmax));
  const auto vscale = hn::Set(df, scale);
  const auto vshift = hn::Set(df, mx * scale);
  auto vsum = hn::Zero(df);
  for (std::size_t i = 0; i < full; i += L) {
    const auto e = hn::Exp(df, hn::Sub(hn::Mul(hn::LoadU(df, logits + i), vscale), vshift));
    hn::StoreU(e, df, logits + i);
    vsum = hn::Add(vsum, e);
  }
  auto etail = hn::Zero(df);
  if (rest != 0) {
    etail = hn::IfThenElseZero(keep, hn::Exp(df, hn::Sub(hn::Mul(hn::Load(df, tail_logits), vscale), vshift)));
    vsum = hn::Add(vsum, etail);
  }
  const float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
  const auto vinv = hn::Set(df, 1.0f / sum);
  for (std::size_t i = 0; i < full; i += L) {
    hn::StoreU(hn::MulAdd(hn::LoadU(df, logits + i), vinv, hn::LoadU(df, acc + i)), df, acc + i);
  }
  if (rest != 0) {
    std::copy_n(acc + full, rest, tail_acc);
    hn::Store(hn::MulAdd(etail, vinv, hn::Load(df, tail_acc)), df, tail_acc);
    hn::Store(etail, df, tail_logits);
    std::copy_n(tail_acc, rest, acc + full);
    std::copy_n(tail_logits, rest, logits + full);
  }
}

// gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)) (the Llama MLP).
void SwigluInPlace(float* gate, const float* up, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t L = hn::Lanes(df);
  const auto one = hn::Set(df, 1.0f);
  const auto lo = hn::Set(df, -88.0f), hi = hn::Set(df, 88.0f);  // exp stays finite
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    const auto g = hn::LoadU(df, gate + i);
    const auto e = hn::Exp(df, hn::Min(hn::Max(hn::Neg(g), lo), hi));
    hn::StoreU(hn::Mul(hn::Div(g, hn::Add(one, e)), hn::LoadU(df, up + i)), df, gate + i);
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

bool Fp16HasNonfinite(const std::uint16_t* x, std::size_t n) {
  const hn::ScalableTag<std::uint16_t> du;
  const std::size_t L = hn::Lanes(du);
  const auto exp_mask = hn::Set(du, 0x7c00);
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    const auto e = hn::And(hn::LoadU(du, x + i), exp_mask);
    if (!hn::AllFalse(du, hn::Eq(e, exp_mask))) return true;
  }
  for (; i < n; ++i) {
    if ((x[i] & 0x7c00) == 0x7c00) return true;
  }
  return false;
}

void AddF32(const float* x, std::size_t n, float* acc) {
  const hn::ScalableTag<float> df;
  const std::size_t L = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + L <= n; i += L) hn::StoreU(hn::Add(hn::LoadU(df, acc + i), hn::LoadU(df, x + i)), df, acc + i);
  for (; i < n; ++i) acc[i] += x[i];
}

float DotF32(const float* x, const float* y, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t L = hn::Lanes(df);
  auto acc = hn::Zero(df);
  std::size_t i = 0;
  for (; i + L <= n; i += L) acc = hn::MulAdd(hn::LoadU(df, x + i), hn::LoadU(df, y + i), acc);
  float s = hn::GetLane(hn::SumOfLanes(df, acc));
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

// Columns [i, i + V * L) of four queries' dot products: 4 x V accumulators, each column vector
// loaded once for the four queries, each query element a broadcast.
template <std::size_t V, class D>
HWY_INLINE void DotColumnsTile(D df, const float* kt, std::size_t ld, std::size_t d, const float* const* qs,
                               float* o, std::size_t ldo, std::size_t i) {
  const std::size_t L = hn::Lanes(df);
  hn::Vec<D> acc[4][V];
  for (auto& row : acc) {
    for (auto& a : row) a = hn::Zero(df);
  }
  for (std::size_t j = 0; j < d; ++j) {
    hn::Vec<D> k[V];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < V; ++c) k[c] = hn::LoadU(df, kt + j * ld + i + c * L);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < 4; ++r) {
      const auto v = hn::Set(df, qs[r][j]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < V; ++c) acc[r][c] = hn::MulAdd(v, k[c], acc[r][c]);
    }
  }
  for (std::size_t r = 0; r < 4; ++r) {
    for (std::size_t c = 0; c < V; ++c) hn::StoreU(acc[r][c], df, o + r * ldo + i + c * L);
  }
}

// out[b * ldo + i] = sum_j q[b * d + j] * kt[j * ld + i] for b < nq and i < n rounded up to whole
// vectors. The keys are transposed ([d, ld], a column per row) so that every query element is a
// broadcast and no dot product needs a horizontal sum: 4 queries x 3 vectors of columns per pass
// (12 independent accumulators keep both FMA pipes busy through the FMA latency), then 2 and 1
// for the last columns.
void DotColumnsF32(const float* kt, std::size_t ld, std::size_t n, std::size_t d, const float* q, std::size_t nq,
                   float* out, std::size_t ldo) {
  const hn::ScalableTag<float> df;
  const std::size_t L = hn::Lanes(df);
  const std::size_t cols = (n + L - 1) / L * L;
  std::size_t b = 0;
  for (; b + 4 <= nq; b += 4) {
    const float* qs[4] = {q + b * d, q + (b + 1) * d, q + (b + 2) * d, q + (b + 3) * d};
    float* o = out + b * ldo;
    std::size_t i = 0;
    for (; i + 3 * L <= cols; i += 3 * L) DotColumnsTile<3>(df, kt, ld, d, qs, o, ldo, i);
    for (; i + 2 * L <= cols; i += 2 * L) DotColumnsTile<2>(df, kt, ld, d, qs, o, ldo, i);
    for (; i < cols; i += L) DotColumnsTile<1>(df, kt, ld, d, qs, o, ldo, i);
  }
  for (; b < nq; ++b) {
    const float* qb = q + b * d;
    for (std::size_t i = 0; i < cols; i += L) {
      auto a = hn::Zero(df);
      for (std::size_t j = 0; j < d; ++j) a = hn::MulAdd(hn::Set(df, qb[j]), hn::LoadU(df, kt + j * ld + i), a);
      hn::StoreU(a, df, out + b * ldo + i);
    }
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kvslim
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvslim {
HWY_EXPORT(ConvertFp16ToF32);
HWY_EXPORT(ConvertBf16ToF32);
HWY_EXPORT(ConvertF32ToFp16);
HWY_EXPORT(DotFp16Rows);
HWY_EXPORT(AxpyFp16Row);
HWY_EXPORT(SoftmaxAccumulate);
HWY_EXPORT(Fp16HasNonfinite);
HWY_EXPORT(SwigluInPlace);
HWY_EXPORT(AddF32);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotColumnsF32);
HWY_EXPORT(TargetName);

void convert_fp16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(ConvertFp16ToF32)(src, dst, n);
}
void convert_f32_to_fp16(const float* src, std::uint16_t* dst, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(ConvertF32ToFp16)(src, dst, n);
}
void convert_to_f32(const void* src, DType type, float* dst, std::size_t n) {
  switch (type) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::f16: HWY_DYNAMIC_DISPATCH(ConvertFp16ToF32)(static_cast<const std::uint16_t*>(src), dst, n); return;
    case DType::bf16: HWY_DYNAMIC_DISPATCH(ConvertBf16ToF32)(static_cast<const std::uint16_t*>(src), dst, n); return;
  }
}
void convert_to_fp16(const void* src, DType type, std::uint16_t* dst, std::size_t n) {
  switch (type) {
    case DType::f16: std::memcpy(dst, src, n * sizeof(std::uint16_t)); return;
    case DType::f32: convert_f32_to_fp16(static_cast<const float*>(src), dst, n); return;
    case DType::bf16: {
      // bf16 -> f32 is exact; then one rounding to fp16 (in chunks: no allocation).
      constexpr std::size_t kChunk = 256;
      float tmp[kChunk];
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i);
        HWY_DYNAMIC_DISPATCH(ConvertBf16ToF32)(s + i, tmp, m);
        convert_f32_to_fp16(tmp, dst + i, m);
      }
      return;
    }
  }
}
void dot_fp16_rows(const std::uint16_t* rows, std::size_t n, std::size_t d, std::size_t stride,
                   const float* q, float* out) {
  HWY_DYNAMIC_DISPATCH(DotFp16Rows)(rows, n, d, stride, q, out);
}
void axpy_fp16_row(float w, const std::uint16_t* row, std::size_t d, float* out) {
  HWY_DYNAMIC_DISPATCH(AxpyFp16Row)(w, row, d, out);
}
const char* simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

namespace kernels {
void softmax_accumulate(float* logits, std::size_t n, float scale, float* acc) {
  HWY_DYNAMIC_DISPATCH(SoftmaxAccumulate)(logits, n, scale, acc);
}
// The attention kernels' max and exp-and-sum, then one scaling pass (no second copy of either).
void softmax_inplace(float* x, std::size_t n) {
  const float inv = 1.0f / attend::exp_shift(x, n, attend::max_f32(x, n));
  for (std::size_t i = 0; i < n; ++i) x[i] *= inv;
}
void swiglu_inplace(float* gate, const float* up, std::size_t n) { HWY_DYNAMIC_DISPATCH(SwigluInPlace)(gate, up, n); }
bool fp16_has_nonfinite(const std::uint16_t* x, std::size_t n) {
  return HWY_DYNAMIC_DISPATCH(Fp16HasNonfinite)(x, n);
}
void add_f32(const float* x, std::size_t n, float* acc) { HWY_DYNAMIC_DISPATCH(AddF32)(x, n, acc); }
float dot_f32(const float* x, const float* y, std::size_t n) { return HWY_DYNAMIC_DISPATCH(DotF32)(x, y, n); }
void dot_columns_f32(const float* kt, std::size_t ld, std::size_t n, std::size_t d, const float* q, std::size_t nq,
                     float* out, std::size_t ldo) {
  HWY_DYNAMIC_DISPATCH(DotColumnsF32)(kt, ld, n, d, q, nq, out, ldo);
}
}  // namespace kernels
}  // namespace kvslim
#endif  // HWY_ONCE
