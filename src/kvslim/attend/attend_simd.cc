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
#include <limits>

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

// Packed rows read in place (quant_kernels.h layout: a `bits`-wide code split into power-of-two
// planes, each packed "across the row": element e of a plane of width w and m bytes sits in byte
// e % m at bit (e / m) * w). When every plane's m is a multiple of the vector length, a vector of
// elements [j, j + L) comes from L consecutive bytes of each plane: load, widen, shift, mask --
// the codes never leave registers.
struct PackedRow {
  int planes = 0;
  std::size_t offset[4] = {}, m[4] = {};
  int width[4] = {}, shift[4] = {};
};

HWY_INLINE PackedRow LayoutOf(std::size_t D, int bits) {
  PackedRow row;
  int shift = 0;
  std::size_t offset = 0;
  for (int w : {8, 4, 2, 1}) {
    if (!(bits & w)) continue;
    row.offset[row.planes] = offset;
    row.m[row.planes] = (D * static_cast<std::size_t>(w) + 7) / 8;
    row.width[row.planes] = w;
    row.shift[row.planes] = shift;
    offset += row.m[row.planes];
    shift += w;
    ++row.planes;
  }
  return row;
}

// Where each vector of elements comes from: per chunk (j = chunk * L) and plane, the byte offset
// in the row and the right shift (a table, so the inner loops do no division).
struct PackedLoader {
  static constexpr std::size_t kMaxChunks = 128;
  int planes = 0;
  int mask[4] = {}, shift[4] = {};
  std::uint32_t offset[4][kMaxChunks] = {};
  int right[4][kMaxChunks] = {};

  PackedLoader(std::size_t D, int bits) {
    const PackedRow layout = LayoutOf(D, bits);
    const std::size_t L = hn::Lanes(DF());
    planes = layout.planes;
    for (int p = 0; p < planes; ++p) {
      mask[p] = (1 << layout.width[p]) - 1;
      shift[p] = layout.shift[p];
      for (std::size_t c = 0; c * L < D; ++c) {
        const std::size_t j = c * L;
        offset[p][c] = static_cast<std::uint32_t>(layout.offset[p] + j % layout.m[p]);
        right[p][c] = static_cast<int>(j / layout.m[p]) * layout.width[p];
      }
    }
  }
  HWY_INLINE hn::Vec<DF> operator()(DF df, const std::uint8_t* row, std::size_t c) const {
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<std::uint8_t, DF> d8;
    auto code = hn::And(hn::ShiftRightSame(hn::PromoteTo(di, hn::LoadU(d8, row + offset[0][c])), right[0][c]),
                        hn::Set(di, mask[0]));
    for (int p = 1; p < planes; ++p) {
      auto b = hn::PromoteTo(di, hn::LoadU(d8, row + offset[p][c]));
      b = hn::And(hn::ShiftRightSame(b, right[p][c]), hn::Set(di, mask[p]));
      code = hn::Or(code, hn::ShiftLeftSame(b, shift[p]));
    }
    return hn::ConvertTo(df, code);
  }
};

bool PackedDirect(std::size_t D, int bits) {
  const std::size_t L = hn::Lanes(DF());
  if (D % L != 0 || D / L > PackedLoader::kMaxChunks) return false;
  const PackedRow layout = LayoutOf(D, bits);
  for (int p = 0; p < layout.planes; ++p) {
    if (layout.m[p] % L != 0) return false;
  }
  return true;
}

template <int NQ>
HWY_INLINE void DotPacked(const float* q, std::size_t D, const std::uint8_t* row, const PackedLoader& load,
                          const float* bias, float* out, std::size_t ld) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  hn::Vec<DF> acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = hn::Zero(df);
  for (std::size_t j = 0, c = 0; j < D; j += L, ++c) {
    const auto k = load(df, row, c);
    for (int i = 0; i < NQ; ++i) acc[i] = hn::MulAdd(k, hn::LoadU(df, q + i * D + j), acc[i]);
  }
  for (int i = 0; i < NQ; ++i) out[i * ld] = hn::GetLane(hn::SumOfLanes(df, acc[i])) + bias[i];
}

void LogitsPacked(const float* q, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits, std::size_t n,
                  const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld) {
  const PackedLoader load(D, bits);
  const PackedRow layout = LayoutOf(D, bits);
  const std::size_t rb = layout.offset[layout.planes - 1] + layout.m[layout.planes - 1];
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* row = packed + r * rb;
    const std::size_t col = idx != nullptr ? idx[r] : r;
    for (std::size_t m = 0; m < M; m += 4) {
      float* o = logits + m * ld + col;
      switch (std::min<std::size_t>(4, M - m)) {
        case 4: DotPacked<4>(q + m * D, D, row, load, bias + m, o, ld); break;
        case 3: DotPacked<3>(q + m * D, D, row, load, bias + m, o, ld); break;
        case 2: DotPacked<2>(q + m * D, D, row, load, bias + m, o, ld); break;
        default: DotPacked<1>(q + m * D, D, row, load, bias + m, o, ld); break;
      }
    }
  }
}

template <int NQ>
HWY_INLINE void AccumulatePackedBlock(const float* p, std::size_t ld, const std::uint8_t* packed, std::size_t rb,
                                      const PackedLoader& load, std::size_t n, std::size_t D, float* acc) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  for (std::size_t j = 0, c = 0; j < D; j += L, ++c) {
    hn::Vec<DF> a[NQ];
    for (int i = 0; i < NQ; ++i) a[i] = hn::LoadU(df, acc + i * D + j);
    for (std::size_t r = 0; r < n; ++r) {
      const auto v = load(df, packed + r * rb, c);
      for (int i = 0; i < NQ; ++i) a[i] = hn::MulAdd(hn::Set(df, p[i * ld + r]), v, a[i]);
    }
    for (int i = 0; i < NQ; ++i) hn::StoreU(a[i], df, acc + i * D + j);
  }
}

void AccumulatePacked(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                      std::size_t n, std::size_t D, float* acc) {
  const PackedLoader load(D, bits);
  const PackedRow layout = LayoutOf(D, bits);
  const std::size_t rb = layout.offset[layout.planes - 1] + layout.m[layout.planes - 1];
  for (std::size_t m = 0; m < M; m += 4) {
    switch (std::min<std::size_t>(4, M - m)) {
      case 4: AccumulatePackedBlock<4>(p + m * ld, ld, packed, rb, load, n, D, acc + m * D); break;
      case 3: AccumulatePackedBlock<3>(p + m * ld, ld, packed, rb, load, n, D, acc + m * D); break;
      case 2: AccumulatePackedBlock<2>(p + m * ld, ld, packed, rb, load, n, D, acc + m * D); break;
      default: AccumulatePackedBlock<1>(p + m * ld, ld, packed, rb, load, n, D, acc + m * D); break;
    }
  }
}

void ScaleQueries(const float* q, std::size_t M, std::size_t D, const float* scale, const float* zero, float* qs,
                  float* bias) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  for (std::size_t m = 0; m < M; ++m) {
    const float* qm = q + m * D;
    float* out = qs + m * D;
    auto b = hn::Zero(df);
    std::size_t c = 0;
    for (; c + L <= D; c += L) {
      const auto qv = hn::LoadU(df, qm + c);
      hn::StoreU(hn::Mul(qv, hn::LoadU(df, scale + c)), df, out + c);
      b = hn::MulAdd(qv, hn::LoadU(df, zero + c), b);
    }
    float sum = hn::GetLane(hn::SumOfLanes(df, b));
    for (; c < D; ++c) {
      out[c] = qm[c] * scale[c];
      sum += qm[c] * zero[c];
    }
    bias[m] = sum;
  }
}

void CombineGroup(const float* gacc, const float* psum, std::size_t M, std::size_t D, const float* scale,
                  const float* zero, float* acc) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  for (std::size_t m = 0; m < M; ++m) {
    const float* g = gacc + m * D;
    float* a = acc + m * D;
    const auto ps = hn::Set(df, psum[m]);
    std::size_t c = 0;
    for (; c + L <= D; c += L) {
      const auto v = hn::MulAdd(hn::LoadU(df, scale + c), hn::LoadU(df, g + c),
                                hn::MulAdd(hn::LoadU(df, zero + c), ps, hn::LoadU(df, a + c)));
      hn::StoreU(v, df, a + c);
    }
    for (; c < D; ++c) a[c] += scale[c] * g[c] + zero[c] * psum[m];
  }
}

// e^x for the softmax weights x = score - max <= 0 (a rounding above 0 is fine up to 88): x is
// clamped below at -86 (e^-86 ~ 4e-38, nothing next to the maximum's weight of 1), written as
// k * ln2 + f with |f| <= ln2 / 2, e^f by a degree-7 polynomial (Highway's Exp coefficients) and
// 2^k added to the exponent bits. Relative error ~2e-7, about half of Exp's work: no range
// checks beyond the clamp, one power of two.
template <class V>
HWY_INLINE V ExpWeight(DF df, V x) {
  const hn::RebindToSigned<DF> di;
  x = hn::Min(hn::Max(x, hn::Set(df, -86.0f)), hn::Set(df, 88.0f));
  const V k = hn::Round(hn::Mul(x, hn::Set(df, 1.44269504088896341f)));
  V f = hn::MulAdd(k, hn::Set(df, -0.693145751953125f), x);  // -ln2 in two parts: f exact to ~1e-10
  f = hn::MulAdd(k, hn::Set(df, -1.428606765330187045e-6f), f);
  V p = hn::Set(df, 0.000198527617612853646278381f);
  p = hn::MulAdd(p, f, hn::Set(df, 0.00139304355252534151077271f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.00833336077630519866943359f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.0416664853692054748535156f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.166666671633720397949219f));
  p = hn::MulAdd(p, f, hn::Set(df, 0.5f));
  const V e = hn::Add(hn::MulAdd(p, hn::Mul(f, f), f), hn::Set(df, 1.0f));  // e^f in [0.7, 1.42]
  return hn::BitCast(df, hn::Add(hn::BitCast(di, e), hn::ShiftLeft<23>(hn::ConvertTo(di, k))));
}

float ExpShift(float* x, std::size_t n, float shift) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  const auto vshift = hn::Set(df, shift);
  const auto ninf = hn::Set(df, -INFINITY);
  auto vsum = hn::Zero(df);
  std::size_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = hn::LoadU(df, x + i);
    const auto e = hn::IfThenZeroElse(hn::Eq(v, ninf), ExpWeight(df, hn::Sub(v, vshift)));
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

float MaxF32(const float* x, std::size_t n) {
  const DF df;
  const std::size_t L = hn::Lanes(df);
  auto vmax = hn::Set(df, -INFINITY);
  std::size_t i = 0;
  for (; i + L <= n; i += L) vmax = hn::Max(vmax, hn::LoadU(df, x + i));
  float mx = hn::GetLane(hn::MaxOfLanes(df, vmax));
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

std::int64_t MaxI64(const std::int64_t* x, std::size_t n) {
  const hn::ScalableTag<std::int64_t> di;
  const std::size_t L = hn::Lanes(di);
  auto vmax = hn::Set(di, std::numeric_limits<std::int64_t>::min());
  std::size_t i = 0;
  for (; i + L <= n; i += L) vmax = hn::Max(vmax, hn::LoadU(di, x + i));
  std::int64_t mx = hn::GetLane(hn::MaxOfLanes(di, vmax));
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
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
HWY_EXPORT(PackedDirect);
HWY_EXPORT(ScaleQueries);
HWY_EXPORT(CombineGroup);
HWY_EXPORT(LogitsPacked);
HWY_EXPORT(AccumulatePacked);
HWY_EXPORT(MaxF32);
HWY_EXPORT(MaxI64);
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
void scale_queries(const float* q, std::size_t M, std::size_t D, const float* scale, const float* zero, float* qs,
                   float* bias) {
  HWY_DYNAMIC_DISPATCH(ScaleQueries)(q, M, D, scale, zero, qs, bias);
}
void combine_group(const float* gacc, const float* psum, std::size_t M, std::size_t D, const float* scale,
                   const float* zero, float* acc) {
  HWY_DYNAMIC_DISPATCH(CombineGroup)(gacc, psum, M, D, scale, zero, acc);
}
bool packed_direct(std::size_t D, int bits) { return HWY_DYNAMIC_DISPATCH(PackedDirect)(D, bits); }
void logits_packed(const float* q, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits, std::size_t n,
                   const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld) {
  HWY_DYNAMIC_DISPATCH(LogitsPacked)(q, M, D, packed, bits, n, bias, idx, logits, ld);
}
void accumulate_packed(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                       std::size_t n, std::size_t D, float* acc) {
  HWY_DYNAMIC_DISPATCH(AccumulatePacked)(p, ld, M, packed, bits, n, D, acc);
}
float max_f32(const float* x, std::size_t n) { return HWY_DYNAMIC_DISPATCH(MaxF32)(x, n); }
std::int64_t max_i64(const std::int64_t* x, std::size_t n) { return HWY_DYNAMIC_DISPATCH(MaxI64)(x, n); }
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace kvslim::attend
#endif  // HWY_ONCE
