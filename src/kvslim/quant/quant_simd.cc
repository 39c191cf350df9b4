// SIMD quantizer kernels (Highway, best target chosen at run time). Each must give exactly the
// scalar reference's bytes and bits (quant_reference.cc); tests/kvslim/quant_simd_test.cc checks it
// on every target this machine supports.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant/quant_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant/quant_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kvslim::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU8 = hn::ScalableTag<std::uint8_t>;

std::size_t RowBytes(std::size_t dim, int bits) {
  Plane planes[4];
  const int n = code_planes(bits, planes);
  std::size_t total = 0;
  for (int i = 0; i < n; ++i) total += plane_bytes(dim, planes[i].width);
  return total;
}

// Codes of one row, one byte each, zero from dim on: [dim + 8 + lanes] (planes read past dim).
std::uint8_t* CodeBuffer(std::vector<std::uint8_t>& buf, std::size_t dim) {
  const std::size_t need = dim + 8 + hn::Lanes(DU8());
  if (buf.size() < need) buf.resize(need);
  std::memset(buf.data() + dim, 0, need - dim);
  return buf.data();
}

// codes: a CodeBuffer. Each plane is stored with whole vectors, so up to a vector past the row's
// last plane is overwritten: the caller points `out` at a buffer with that much room (the next row,
// written afterwards, or a scratch row).
void PackRow(const std::uint8_t* codes, std::size_t dim, int bits, std::uint8_t* out) {
  const DU8 d8;
  const std::size_t L = hn::Lanes(d8);
  Plane planes[4];
  const int n_planes = code_planes(bits, planes);
  for (int pi = 0; pi < n_planes; ++pi) {
    const int p = planes[pi].width, shift = planes[pi].shift;
    const std::size_t m = plane_bytes(dim, p), k = 8 / p;
    const auto mask = hn::Set(d8, static_cast<std::uint8_t>((1u << p) - 1u));
    for (std::size_t i = 0; i < m; i += L) {
      auto acc = hn::Zero(d8);
      for (std::size_t t = 0; t < k; ++t) {
        const auto v = hn::And(hn::ShiftRightSame(hn::LoadU(d8, codes + i + t * m), shift), mask);
        acc = hn::Or(acc, hn::ShiftLeftSame(v, static_cast<int>(p * t)));
      }
      hn::StoreU(acc, d8, out + i);
    }
    out += m;
  }
}

// Packs rows r < n (codes produced by `encode(r, row_codes)`) into out + r * rb; the last rows go
// through `tmp` ([rb + lanes]) so nothing past out + n * rb is written. Rows are encoded a tile at a
// time before any is packed: packing reads the codes with wide loads at plane offsets, which would
// stall on store forwarding if they followed the encoder's narrow stores immediately.
template <class Encode>
void PackRowsWith(std::size_t n, std::size_t dim, int bits, std::uint8_t* out, std::vector<std::uint8_t>& tile_buf,
                  std::uint8_t* tmp, Encode encode) {
  constexpr std::size_t kTile = 32;
  const std::size_t rb = RowBytes(dim, bits), L = hn::Lanes(DU8()), stride = dim + 8 + L;
  if (tile_buf.size() < kTile * stride) tile_buf.resize(kTile * stride);
  for (std::size_t r0 = 0; r0 < n; r0 += kTile) {
    const std::size_t count = std::min(kTile, n - r0);
    for (std::size_t j = 0; j < count; ++j) {
      std::uint8_t* codes = tile_buf.data() + j * stride;
      std::memset(codes + dim, 0, stride - dim);  // planes read past dim: zero codes
      encode(r0 + j, codes);
    }
    for (std::size_t j = 0; j < count; ++j) {
      const std::size_t r = r0 + j;
      const std::uint8_t* codes = tile_buf.data() + j * stride;
      if ((n - 1 - r) * rb >= L) {  // the rows after this one absorb the vector spill
        PackRow(codes, dim, bits, out + r * rb);
      } else {
        PackRow(codes, dim, bits, tmp);
        std::memcpy(out + r * rb, tmp, rb);
      }
    }
  }
}

// codes: [dim + 8 + lanes] bytes, overwritten (entries past dim are scratch). `packed` must be
// readable for a vector past the row (the caller copies the last row of a buffer to a scratch row);
// bytes past each plane are masked off. Regions are written in order t = 0, 1, ...: the last vector
// of region t spills zeros into the start of region t + 1, written or OR-ed afterwards.
void UnpackRow(const std::uint8_t* packed, std::size_t dim, int bits, std::uint8_t* codes) {
  const DU8 d8;
  const std::size_t L = hn::Lanes(d8);
  Plane planes[4];
  const int n_planes = code_planes(bits, planes);
  for (int pi = 0; pi < n_planes; ++pi) {
    const int p = planes[pi].width, shift = planes[pi].shift;
    const std::size_t m = plane_bytes(dim, p), k = 8 / p;
    const auto mask = hn::Set(d8, static_cast<std::uint8_t>((1u << p) - 1u));
    for (std::size_t t = 0; t < k; ++t) {
      std::uint8_t* region = codes + t * m;
      for (std::size_t i = 0; i < m; i += L) {
        auto v = hn::LoadU(d8, packed + i);
        if (i + L > m) v = hn::IfThenElseZero(hn::FirstN(d8, m - i), v);
        const auto c = hn::ShiftLeftSame(hn::And(hn::ShiftRightSame(v, static_cast<int>(p * t)), mask), shift);
        if (pi == 0) {
          hn::StoreU(c, d8, region + i);
        } else {
          hn::StoreU(hn::Or(hn::LoadU(d8, region + i), c), d8, region + i);
        }
      }
    }
    packed += m;
  }
}

// Row r of packed rows, readable for a vector past its end: in place, or (the last rows of the
// buffer) copied into tmp ([rb + lanes]).
const std::uint8_t* ReadableRow(const std::uint8_t* packed, std::size_t r, std::size_t n, std::size_t rb,
                                std::uint8_t* tmp) {
  if ((n - 1 - r) * rb >= hn::Lanes(DU8())) return packed + r * rb;
  std::memcpy(tmp, packed + r * rb, rb);
  return tmp;
}

void EncodeRow(const float* x, std::size_t dim, const float* scale, const float* zero, float levels,
               std::uint8_t* codes) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di;
  const hn::Rebind<std::uint8_t, DF> d8;
  const std::size_t N = hn::Lanes(df);
  const auto vzero = hn::Zero(df), vlev = hn::Set(df, levels);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    auto q = hn::Div(hn::Sub(hn::LoadU(df, x + c), hn::LoadU(df, zero + c)), hn::LoadU(df, scale + c));
    q = hn::Min(hn::Max(hn::Round(q), vzero), vlev);
    hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, q)), d8, codes + c);
  }
  for (; c < dim; ++c) {
    const float q = std::nearbyint((x[c] - zero[c]) / scale[c]);
    codes[c] = static_cast<std::uint8_t>(std::min(std::max(q, 0.0f), levels));
  }
}

// fp32 -> fp16 bits, round to nearest even, for every target (Highway's emulation on targets
// without F16C truncates, so it is not used).
template <class V>
hn::Vec<hn::Rebind<std::uint16_t, DF>> ToF16Bits(V v) {
  const DF df;
  const hn::Rebind<std::uint16_t, DF> d16;
#if HWY_TARGET >= HWY_SSE4
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  const auto absx = hn::And(bits, hn::Set(du, 0x7fffffffu));
  const auto odd = hn::And(hn::ShiftRight<13>(absx), hn::Set(du, 1u));
  const auto normal = hn::ShiftRight<13>(hn::Add(hn::Add(absx, hn::Set(du, 0xc8000fffu)), odd));
  const auto shifted = hn::Add(hn::BitCast(df, absx), hn::Set(df, 0.5f));
  const auto sub = hn::Sub(hn::BitCast(du, shifted), hn::Set(du, 0x3f000000u));
  const auto absi = hn::BitCast(di, absx);
  const auto nan_or_inf = hn::IfThenElse(hn::RebindMask(du, absi > hn::Set(di, 0x7f800000)), hn::Set(du, 0x7e00u),
                                         hn::Set(du, 0x7c00u));
  auto r = hn::IfThenElse(hn::RebindMask(du, absi < hn::Set(di, 0x38800000)), sub, normal);
  r = hn::IfThenElse(hn::RebindMask(du, absi > hn::Set(di, 0x477ff000 - 1)), hn::Set(du, 0x7c00u), r);
  r = hn::IfThenElse(hn::RebindMask(du, absi > hn::Set(di, 0x7f800000 - 1)), nan_or_inf, r);
  r = hn::Or(r, sign);
  return hn::DemoteTo(d16, hn::BitCast(di, r));
#else
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::BitCast(d16, hn::DemoteTo(dh, v));
#endif
}

// fp32 -> fp16 bits (round to nearest even) held in u32 lanes.
template <class V>
hn::Vec<hn::RebindToUnsigned<DF>> ToF16BitsU32(V v) {
  const hn::RebindToUnsigned<DF> du;
  return hn::PromoteTo(du, ToF16Bits(v));
}

// fp16 bits held in u32 lanes -> fp32, exact.
template <class VU>
hn::Vec<DF> F16BitsToF32(VU h) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
#if HWY_TARGET >= HWY_SSE4
  // (h & 0x7fff) << 13 read as float is the value times 2^-112 (subnormals included); Highway's
  // emulation without F16C turns infinity into 65536, so it is not used.
  const auto e = hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x7fffu)));
  const auto finite = hn::BitCast(du, hn::Mul(hn::BitCast(df, e), hn::Set(df, 5.192296858534828e33f)));  // 2^112
  const auto special = hn::Eq(hn::And(h, hn::Set(du, 0x7c00u)), hn::Set(du, 0x7c00u));
  const auto mag = hn::IfThenElse(special, hn::Or(e, hn::Set(du, 0x7f800000u)), finite);
  return hn::BitCast(df, hn::Or(mag, hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)))));
#else
  const hn::Rebind<std::uint16_t, DF> d16;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const hn::RebindToSigned<DF> di;
  return hn::PromoteTo(df, hn::BitCast(dh, hn::DemoteTo(d16, hn::BitCast(di, h))));
#endif
}

void MakeParams(const float* mn, const float* mx, std::size_t dim, int bits, std::uint16_t* scale_h,
                std::uint16_t* zero_h, float* scale_f, float* zero_f) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
  const float levels = static_cast<float>((1u << bits) - 1u);
  const auto vlev = hn::Set(df, levels), floor = hn::Set(df, 1e-8f);
  const auto one = hn::Set(du, 1u), top = hn::Set(du, 0x7bffu);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    const auto zh = ToF16BitsU32(hn::LoadU(df, mn + c));
    const auto zf = F16BitsToF32(zh);
    const auto sv = hn::Max(hn::Div(hn::Sub(hn::LoadU(df, mx + c), zf), vlev), floor);
    auto sh = ToF16BitsU32(sv);
    sh = hn::IfThenElse(hn::RebindMask(du, F16BitsToF32(sh) < sv), hn::Add(sh, one), sh);
    sh = hn::Min(sh, top);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, zh)), d16, zero_h + c);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, sh)), d16, scale_h + c);
    hn::StoreU(zf, df, zero_f + c);
    hn::StoreU(F16BitsToF32(sh), df, scale_f + c);
  }
  for (; c < dim; ++c) {
    const std::uint16_t z = f32_to_fp16(mn[c]);
    const float zf = fp16_to_f32(z);
    const float sv = std::max((mx[c] - zf) / levels, 1e-8f);
    std::uint16_t sh = f32_to_fp16(sv);
    if (fp16_to_f32(sh) < sv) ++sh;
    if (sh > 0x7bffu) sh = 0x7bffu;
    zero_h[c] = z;
    scale_h[c] = sh;
    zero_f[c] = zf;
    scale_f[c] = fp16_to_f32(sh);
  }
}

void ParamsToF32(const std::uint16_t* scale_h, const std::uint16_t* zero_h, std::size_t dim, float* scale_f,
                 float* zero_f) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    hn::StoreU(F16BitsToF32(hn::PromoteTo(du, hn::LoadU(d16, scale_h + c))), df, scale_f + c);
    hn::StoreU(F16BitsToF32(hn::PromoteTo(du, hn::LoadU(d16, zero_h + c))), df, zero_f + c);
  }
  for (; c < dim; ++c) {
    scale_f[c] = fp16_to_f32(scale_h[c]);
    zero_f[c] = fp16_to_f32(zero_h[c]);
  }
}

void DecodeRowF16(const std::uint8_t* codes, std::size_t dim, const float* scale, const float* zero,
                  std::uint16_t* out) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di;
  const hn::Rebind<std::uint8_t, DF> d8;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    const auto f = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, codes + c)));
    const auto y = hn::Add(hn::Mul(f, hn::LoadU(df, scale + c)), hn::LoadU(df, zero + c));
    hn::StoreU(ToF16Bits(y), d16, out + c);
  }
  for (; c < dim; ++c) {
    const float prod = static_cast<float>(codes[c]) * scale[c];
    out[c] = f32_to_fp16(prod + zero[c]);
  }
}

void DecodeRowF32(const std::uint8_t* codes, std::size_t dim, const float* scale, const float* zero,
                  float* out) {
  const DF df;
  const hn::Rebind<std::int32_t, DF> di;
  const hn::Rebind<std::uint8_t, DF> d8;
  const std::size_t N = hn::Lanes(df);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    const auto f = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, codes + c)));
    hn::StoreU(hn::Add(hn::Mul(f, hn::LoadU(df, scale + c)), hn::LoadU(df, zero + c)), df, out + c);
  }
  for (; c < dim; ++c) {
    const float prod = static_cast<float>(codes[c]) * scale[c];
    out[c] = prod + zero[c];
  }
}

void GroupMinmax(const float* const* rows, std::size_t n, std::size_t dim, float* mn, float* mx) {
  const DF df;
  const std::size_t N = hn::Lanes(df);
  std::size_t c = 0;
  for (; c + N <= dim; c += N) {
    auto lo = hn::LoadU(df, rows[0] + c), hi = lo;
    for (std::size_t r = 1; r < n; ++r) {
      const auto v = hn::LoadU(df, rows[r] + c);
      lo = hn::Min(lo, v);
      hi = hn::Max(hi, v);
    }
    hn::StoreU(lo, df, mn + c);
    hn::StoreU(hi, df, mx + c);
  }
  for (; c < dim; ++c) {
    float lo = rows[0][c], hi = lo;
    for (std::size_t r = 1; r < n; ++r) {
      lo = std::min(lo, rows[r][c]);
      hi = std::max(hi, rows[r][c]);
    }
    mn[c] = lo;
    mx[c] = hi;
  }
}

std::uint8_t* TmpRow(std::vector<std::uint8_t>& buf, std::size_t dim, int bits) {
  const std::size_t need = RowBytes(dim, bits) + hn::Lanes(DU8());
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

void EncodePackRows(const float* const* rows, std::size_t n, std::size_t dim, const float* scale,
                    const float* zero, int bits, std::uint8_t* out) {
  thread_local std::vector<std::uint8_t> tile_buf, tmp_buf;
  const float levels = static_cast<float>((1u << bits) - 1u);
  PackRowsWith(n, dim, bits, out, tile_buf, TmpRow(tmp_buf, dim, bits),
               [&](std::size_t r, std::uint8_t* codes) { EncodeRow(rows[r], dim, scale, zero, levels, codes); });
}

// Single-plane widths (1, 2, 4, 8): codes go straight from the packed bytes to fp32 lanes, no
// intermediate code row. `packed` readable for a vector past the row (ReadableRow).
void DecodeRowF16SinglePlane(const std::uint8_t* packed, std::size_t dim, int p, const float* scale,
                             const float* zero, std::uint16_t* out) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::uint8_t, DF> d8;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
  const std::size_t m = plane_bytes(dim, p), k = 8 / p;
  const unsigned mask = (1u << p) - 1u;
  const auto vmask = hn::Set(du, mask);
  for (std::size_t t = 0; t < k; ++t) {
    const std::size_t base = t * m;  // elements base + i come from byte i, bits p*t
    if (base >= dim) break;
    const std::size_t len = std::min(m, dim - base);
    std::size_t i = 0;
    for (; i + N <= len; i += N) {
      const auto c = hn::And(hn::ShiftRightSame(hn::PromoteTo(du, hn::LoadU(d8, packed + i)), static_cast<int>(p * t)), vmask);
      const auto y = hn::Add(hn::Mul(hn::ConvertTo(df, c), hn::LoadU(df, scale + base + i)), hn::LoadU(df, zero + base + i));
      hn::StoreU(ToF16Bits(y), d16, out + base + i);
    }
    for (; i < len; ++i) {
      const float code = static_cast<float>((packed[i] >> (p * t)) & mask);
      const float prod = code * scale[base + i];
      out[base + i] = f32_to_fp16(prod + zero[base + i]);
    }
  }
}

void DecodeRowsF16(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                   const float* zero, int bits, std::uint16_t* const* out_rows) {
  thread_local std::vector<std::uint8_t> code_buf, tmp_buf;
  std::uint8_t* codes = CodeBuffer(code_buf, dim);
  std::uint8_t* tmp = TmpRow(tmp_buf, dim, bits);
  const std::size_t rb = RowBytes(dim, bits);
  const bool single_plane = (bits & (bits - 1)) == 0;
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* row = ReadableRow(packed, r, n, rb, tmp);
    if (single_plane) {
      DecodeRowF16SinglePlane(row, dim, bits, scale, zero, out_rows[r]);
    } else {
      UnpackRow(row, dim, bits, codes);
      DecodeRowF16(codes, dim, scale, zero, out_rows[r]);
    }
  }
}

void DecodeRowsF32(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                   const float* zero, int bits, float* const* out_rows) {
  thread_local std::vector<std::uint8_t> code_buf, tmp_buf;
  std::uint8_t* codes = CodeBuffer(code_buf, dim);
  std::uint8_t* tmp = TmpRow(tmp_buf, dim, bits);
  const std::size_t rb = RowBytes(dim, bits);
  for (std::size_t r = 0; r < n; ++r) {
    UnpackRow(ReadableRow(packed, r, n, rb, tmp), dim, bits, codes);
    DecodeRowF32(codes, dim, scale, zero, out_rows[r]);
  }
}

void PackRows(const std::uint8_t* codes_in, std::size_t n, std::size_t dim, int bits, std::uint8_t* out) {
  thread_local std::vector<std::uint8_t> tile_buf, tmp_buf;
  PackRowsWith(n, dim, bits, out, tile_buf, TmpRow(tmp_buf, dim, bits),
               [&](std::size_t r, std::uint8_t* codes) { std::memcpy(codes, codes_in + r * dim, dim); });
}

void UnpackRows(const std::uint8_t* packed, std::size_t n, std::size_t dim, int bits, std::uint8_t* codes_out) {
  thread_local std::vector<std::uint8_t> code_buf, tmp_buf;
  std::uint8_t* codes = CodeBuffer(code_buf, dim);
  std::uint8_t* tmp = TmpRow(tmp_buf, dim, bits);
  const std::size_t rb = RowBytes(dim, bits);
  for (std::size_t r = 0; r < n; ++r) {
    UnpackRow(ReadableRow(packed, r, n, rb, tmp), dim, bits, codes);
    std::memcpy(codes_out + r * dim, codes, dim);
  }
}

void ToF32(const void* src, DType type, float* dst, std::size_t n) {
  const DF df;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  if (type == DType::f32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (type == DType::f16) {
    const auto* s16 = static_cast<const std::uint16_t*>(src);
    const hn::Rebind<std::uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> du;
    for (; i + N <= n; i += N) hn::StoreU(F16BitsToF32(hn::PromoteTo(du, hn::LoadU(d16, s16 + i))), df, dst + i);
    for (; i < n; ++i) dst[i] = fp16_to_f32(s16[i]);
  } else {
    const hn::Rebind<hwy::bfloat16_t, DF> db;
    const auto* s = static_cast<const hwy::bfloat16_t*>(src);
    for (; i + N <= n; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(db, s + i)), df, dst + i);
    const auto* s16 = static_cast<const std::uint16_t*>(src);
    for (; i < n; ++i) dst[i] = bf16_to_f32(s16[i]);
  }
}

void F32ToF16(const float* src, std::uint16_t* dst, std::size_t n) {
  const DF df;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(ToF16Bits(hn::LoadU(df, src + i)), d16, dst + i);
  for (; i < n; ++i) dst[i] = f32_to_fp16(src[i]);
}

std::size_t FirstUnrepresentable(const float* x, std::size_t n) {
  const DF df;
  const std::size_t N = hn::Lanes(df);
  const auto limit = hn::Set(df, 65504.0f);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto ok = hn::Abs(hn::LoadU(df, x + i)) <= limit;  // false for NaN
    if (!hn::AllTrue(df, ok)) break;
  }
  for (; i < n; ++i) {
    if (!(std::fabs(x[i]) <= 65504.0f)) return i;
  }
  return n;
}

double SumSquares(const float* x, std::size_t n) {
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const std::size_t N = hn::Lanes(dd);
  auto acc = hn::Zero(dd);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::PromoteTo(dd, hn::LoadU(dfh, x + i));
    acc = hn::MulAdd(v, v, acc);
  }
  double s = hn::GetLane(hn::SumOfLanes(dd, acc));
#else
  double s = 0;
  std::size_t i = 0;
#endif
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void RowNormsF16(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, double* out) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::size_t N = hn::Lanes(df);
#if HWY_HAVE_FLOAT64
  const hn::Repartition<double, DF> dd;  // half as many double lanes
  const hn::Half<DF> dfh;
#endif
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint16_t* x = rows[r];
    double s = 0;
    std::size_t c = 0;
#if HWY_HAVE_FLOAT64
    auto acc = hn::Zero(dd);
    for (; c + N <= dim; c += N) {
      const auto f = F16BitsToF32(hn::PromoteTo(du, hn::LoadU(d16, x + c)));
      const auto lo = hn::PromoteTo(dd, hn::LowerHalf(dfh, f));
      const auto hi = hn::PromoteTo(dd, hn::UpperHalf(dfh, f));
      acc = hn::MulAdd(lo, lo, acc);
      acc = hn::MulAdd(hi, hi, acc);
    }
    s = hn::GetLane(hn::SumOfLanes(dd, acc));
#endif
    for (; c < dim; ++c) {
      const double v = fp16_to_f32(x[c]);
      s += v * v;
    }
    out[r] = std::sqrt(s);
  }
}

void RowsF16ToF32(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, float* dst) {
  for (std::size_t r = 0; r < n; ++r) ToF32(rows[r], DType::f16, dst + r * dim, dim);
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kvslim::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvslim::quant {

HWY_EXPORT(GroupMinmax);
HWY_EXPORT(EncodePackRows);
HWY_EXPORT(DecodeRowsF16);
HWY_EXPORT(DecodeRowsF32);
HWY_EXPORT(PackRows);
HWY_EXPORT(UnpackRows);
HWY_EXPORT(MakeParams);
HWY_EXPORT(ParamsToF32);
HWY_EXPORT(ToF32);
HWY_EXPORT(F32ToF16);
HWY_EXPORT(FirstUnrepresentable);
HWY_EXPORT(SumSquares);
HWY_EXPORT(RowNormsF16);
HWY_EXPORT(RowsF16ToF32);
HWY_EXPORT(TargetName);

namespace {
void group_minmax(const float* const* rows, std::size_t n, std::size_t dim, float* mn, float* mx) {
  HWY_DYNAMIC_DISPATCH(GroupMinmax)(rows, n, dim, mn, mx);
}
void encode_pack_rows(const float* const* rows, std::size_t n, std::size_t dim, const float* scale,
                      const float* zero, int bits, std::uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodePackRows)(rows, n, dim, scale, zero, bits, out);
}
void decode_rows_f16(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                     const float* zero, int bits, std::uint16_t* const* out_rows) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsF16)(packed, n, dim, scale, zero, bits, out_rows);
}
void decode_rows_f32(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                     const float* zero, int bits, float* const* out_rows) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsF32)(packed, n, dim, scale, zero, bits, out_rows);
}
void pack_rows(const std::uint8_t* codes, std::size_t n, std::size_t dim, int bits, std::uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(PackRows)(codes, n, dim, bits, out);
}
void unpack_rows(const std::uint8_t* packed, std::size_t n, std::size_t dim, int bits, std::uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(UnpackRows)(packed, n, dim, bits, codes);
}
void make_params(const float* mn, const float* mx, std::size_t dim, int bits, std::uint16_t* scale_h,
                 std::uint16_t* zero_h, float* scale_f, float* zero_f) {
  HWY_DYNAMIC_DISPATCH(MakeParams)(mn, mx, dim, bits, scale_h, zero_h, scale_f, zero_f);
}
void params_to_f32(const std::uint16_t* scale_h, const std::uint16_t* zero_h, std::size_t dim, float* scale_f,
                   float* zero_f) {
  HWY_DYNAMIC_DISPATCH(ParamsToF32)(scale_h, zero_h, dim, scale_f, zero_f);
}
void to_f32(const void* src, DType type, float* dst, std::size_t n) { HWY_DYNAMIC_DISPATCH(ToF32)(src, type, dst, n); }
void f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) { HWY_DYNAMIC_DISPATCH(F32ToF16)(src, dst, n); }
std::size_t first_unrepresentable(const float* x, std::size_t n) {
  return HWY_DYNAMIC_DISPATCH(FirstUnrepresentable)(x, n);
}
double sum_squares(const float* x, std::size_t n) { return HWY_DYNAMIC_DISPATCH(SumSquares)(x, n); }
void row_norms_f16(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, double* out) {
  HWY_DYNAMIC_DISPATCH(RowNormsF16)(rows, n, dim, out);
}
void rows_f16_to_f32(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, float* dst) {
  HWY_DYNAMIC_DISPATCH(RowsF16ToF32)(rows, n, dim, dst);
}
}  // namespace

const Kernels& simd_kernels() {
  static const Kernels k{"simd",     group_minmax, encode_pack_rows, decode_rows_f16,       decode_rows_f32,
                         pack_rows,  unpack_rows,  make_params,      params_to_f32,         to_f32,
                         f32_to_f16, first_unrepresentable,          sum_squares,           row_norms_f16,
                         rows_f16_to_f32};
  return k;
}

const char* simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace kvslim::quant
#endif  // HWY_ONCE
