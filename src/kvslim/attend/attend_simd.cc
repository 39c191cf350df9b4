// Attention kernels over stored rows, compiled for every x86 target Highway knows and chosen at run
// time (the pattern of quant/quant_simd.cc). Up to four query vectors share each load of a row (GQA:
// the query heads of one KV head), so a row is read from memory once per call.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attend/attend_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attend/attend_kernels.h"
#include "kvslim/dtype.h"

HWY_BEFORE_NAMESPACE();
namespace kvslim::attend {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// Loads L elements of a row as fp32: fp16 promoted, u8 codes widened.
HWY_INLINE hn::Vec<DF> LoadRow(DF df, const std::uint16_t* p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}
HWY_INLINE hn::Vec<DF> LoadRow(DF df, const std::uint8_t* p) {
  const hn::Rebind<std::uint8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, p)));
}
HWY_INLINE float ScalarOf(const std::uint16_t x) { return fp16_to_f32(x); }
HWY_INLINE float ScalarOf(const std::uint8_t x) { return static_cast<float>(x); }

// NQ query vectors against one row: out[i * ld] = q_i . row (+ bias_i).
template <int NQ, class T>
HWY_INLINE void DotRow(const float* q, std::size_t D, const T* row, const float* bias, float* out, std::size_t ld) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  hn::Vec<DF> acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = hn::Zero(df);
  std::size_t j = 0;
  for (; j + L <= D; j += L) {
    const auto k = LoadRow(df, row + j);
    for (int i = 0; i < NQ; ++i) acc[i] = hn::MulAdd(k, hn::LoadU(df, q + i * D + j), acc[i]);
  }
  for (int i = 0; i < NQ; ++i) {
    float s = hn::GetLane(hn::SumOfLanes(df, acc[i]));
    for (std::size_t t = j; t < D; ++t) s += q[i * D + t] * ScalarOf(row[t]);
    out[i * ld] = bias != nullptr ? s + bias[i] : s;
  }
}

template <class T>
void Logits(const float* q, std::size_t M, std::size_t D, const T* keys, std::size_t stride, std::size_t n,
            const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld) {
  for (std::size_t r = 0; r < n; ++r) {
    const T* row = keys + r * stride;
    const std::size_t col = idx != nullptr ? idx[r] : r;
    for (std::size_t m = 0; m < M; m += 4) {  // the row stays in L1 across query blocks
      const float* qb = q + m * D;
      const float* bb = bias != nullptr ? bias + m : nullptr;
      float* o = logits + m * ld + col;
      switch (std::min<std::size_t>(4, M - m)) {
        case 4: DotRow<4>(qb, D, row, bb, o, ld); break;
        case 3: DotRow<3>(qb, D, row, bb, o, ld); break;
        case 2: DotRow<2>(qb, D, row, bb, o, ld); break;
        default: DotRow<1>(qb, D, row, bb, o, ld); break;
      }
    }
  }
}

void LogitsF16(const float* q, std::size_t M, std::size_t D, const std::uint16_t* keys, std::size_t stride,
               std::size_t n, float* logits, std::size_t ld) {
  Logits(q, M, D, keys, stride, n, nullptr, nullptr, logits, ld);
}
void LogitsCodes(const float* q, std::size_t M, std::size_t D, const std::uint8_t* codes, std::size_t n,
                 const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld) {
  Logits(q, M, D, codes, D, n, bias, idx, logits, ld);
}

// NQ accumulators [D] += sum_r p_i[r] * row_r, one vector of channels at a time (the rows of the
// segment stay in L1 across the channel loop; the accumulators stay in registers across rows).
template <int NQ, class T>
HWY_INLINE void AccumulateBlock(const float* p, std::size_t ld, const T* values, std::size_t stride, std::size_t n,
                                std::size_t D, float* acc) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  std::size_t j = 0;
  for (; j + L <= D; j += L) {
    hn::Vec<DF> a[NQ];
    for (int i = 0; i < NQ; ++i) a[i] = hn::LoadU(df, acc + i * D + j);
    for (std::size_t r = 0; r < n; ++r) {
      const auto v = LoadRow(df, values + r * stride + j);
      for (int i = 0; i < NQ; ++i) a[i] = hn::MulAdd(hn::Set(df, p[i * ld + r]), v, a[i]);
    }
    for (int i = 0; i < NQ; ++i) hn::StoreU(a[i], df, acc + i * D + j);
  }
  for (; j < D; ++j) {
    for (int i = 0; i < NQ; ++i) {
      float s = acc[i * D + j];
      for (std::size_t r = 0; r < n; ++r) s += p[i * ld + r] * ScalarOf(values[r * stride + j]);
      acc[i * D + j] = s;
    }
  }
}

template <class T>
void Accumulate(const float* p, std::size_t ld, std::size_t M, const T* values, std::size_t stride, std::size_t n,
                std::size_t D, float* acc) {
  for (std::size_t m = 0; m < M; m += 4) {
    const float* pb = p + m * ld;
    float* ab = acc + m * D;
    switch (std::min<std::size_t>(4, M - m)) {
      case 4: AccumulateBlock<4>(pb, ld, values, stride, n, D, ab); break;
      case 3: AccumulateBlock<3>(pb, ld, values, stride, n, D, ab); break;
      case 2: AccumulateBlock<2>(pb, ld, values, stride, n, D, ab); break;
      default: AccumulateBlock<1>(pb, ld, values, stride, n, D, ab); break;
    }
  }
}

void AccumulateF16(const float* p, std::size_t ld, std::size_t M, const std::uint16_t* values, std::size_t stride,
                   std::size_t n, std::size_t D, float* acc) {
  Accumulate(p, ld, M, values, stride, n, D, acc);
}
void AccumulateCodes(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* codes, std::size_t n,
                     std::size_t D, float* acc) {
  Accumulate(p, ld, M, codes, D, n, D, acc);
}

float ExpShift(float* x, std::size_t n, float shift) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  const auto vshift = hn::Set(df, shift);
  const auto floor = hn::Set(df, -100.0f);  // exp(-100) ~ 4e-44: the lower end of Exp's range
  const auto ninf = hn::Set(df, -INFINITY);
  auto vsum = hn::Zero(df);
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = hn::LoadU(df, x + i);
    const auto e = hn::IfThenZeroElse(hn::Eq(v, ninf), hn::Exp(df, hn::Max(hn::Sub(v, vshift), floor)));
    hn::StoreU(e, df, x + i);
    vsum = hn::Add(vsum, e);
  }
  float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
  for (; i < n; ++i) {
    x[i] = x[i] == -INFINITY ? 0.0f : std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kvslim::attend
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvslim::attend {

HWY_EXPORT(LogitsF16);
HWY_EXPORT(LogitsCodes);
HWY_EXPORT(AccumulateF16);
HWY_EXPORT(AccumulateCodes);
HWY_EXPORT(ExpShift);
HWY_EXPORT(TargetName);

void logits_f16(const float* q, std::size_t M, std::size_t D, const std::uint16_t* keys, std::size_t stride,
                std::size_t n, float* logits, std::size_t ld) {
  HWY_DYNAMIC_DISPATCH(LogitsF16)(q, M, D, keys, stride, n, logits, ld);
}
void logits_codes(const float* q, std::size_t M, std::size_t D, const std::uint8_t* codes, std::size_t n,
                  const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld) {
  HWY_DYNAMIC_DISPATCH(LogitsCodes)(q, M, D, codes, n, bias, idx, logits, ld);
}
void accumulate_f16(const float* p, std::size_t ld, std::size_t M, const std::uint16_t* values, std::size_t stride,
                    std::size_t n, std::size_t D, float* acc) {
  HWY_DYNAMIC_DISPATCH(AccumulateF16)(p, ld, M, values, stride, n, D, acc);
}
void accumulate_codes(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* codes, std::size_t n,
                      std::size_t D, float* acc) {
  HWY_DYNAMIC_DISPATCH(AccumulateCodes)(p, ld, M, codes, n, D, acc);
}
float exp_shift(float* x, std::size_t n, float shift) { return HWY_DYNAMIC_DISPATCH(ExpShift)(x, n, shift); }
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace kvslim::attend
#endif  // HWY_ONCE
