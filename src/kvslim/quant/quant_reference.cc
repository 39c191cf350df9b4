// Scalar reference of the quantizer kernels: the definition the SIMD kernels must match bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "quant/quant_kernels.h"

namespace kvslim::quant {
namespace {

void group_minmax(const float* const* rows, std::size_t n, std::size_t dim, float* mn, float* mx) {
  std::copy(rows[0], rows[0] + dim, mn);
  std::copy(rows[0], rows[0] + dim, mx);
  for (std::size_t r = 1; r < n; ++r) {
    for (std::size_t c = 0; c < dim; ++c) {
      mn[c] = std::min(mn[c], rows[r][c]);
      mx[c] = std::max(mx[c], rows[r][c]);
    }
  }
}

void pack_row(const std::uint8_t* codes, std::size_t dim, int bits, std::uint8_t* out) {
  Plane planes[4];
  const int n_planes = code_planes(bits, planes);
  for (int pi = 0; pi < n_planes; ++pi) {
    const int p = planes[pi].width;
    const std::size_t m = plane_bytes(dim, p), k = 8 / p;
    const unsigned mask = (1u << p) - 1u;
    for (std::size_t i = 0; i < m; ++i) {
      unsigned byte = 0;
      for (std::size_t t = 0; t < k; ++t) {
        const std::size_t j = i + t * m;
        if (j < dim) byte |= ((codes[j] >> planes[pi].shift) & mask) << (p * t);
      }
      out[i] = static_cast<std::uint8_t>(byte);
    }
    out += m;
  }
}

void unpack_row(const std::uint8_t* packed, std::size_t dim, int bits, std::uint8_t* codes) {
  std::fill(codes, codes + dim, std::uint8_t{0});
  Plane planes[4];
  const int n_planes = code_planes(bits, planes);
  for (int pi = 0; pi < n_planes; ++pi) {
    const int p = planes[pi].width;
    const std::size_t m = plane_bytes(dim, p), k = 8 / p;
    const unsigned mask = (1u << p) - 1u;
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t t = 0; t < k; ++t) {
        const std::size_t j = i + t * m;
        if (j < dim) codes[j] |= static_cast<std::uint8_t>(((packed[i] >> (p * t)) & mask) << planes[pi].shift);
      }
    }
    packed += m;
  }
}

std::size_t row_bytes(std::size_t dim, int bits) {
  Plane planes[4];
  const int n = code_planes(bits, planes);
  std::size_t total = 0;
  for (int i = 0; i < n; ++i) total += plane_bytes(dim, planes[i].width);
  return total;
}

void pack_rows(const std::uint8_t* codes, std::size_t n, std::size_t dim, int bits, std::uint8_t* out) {
  const std::size_t rb = row_bytes(dim, bits);
  for (std::size_t r = 0; r < n; ++r) pack_row(codes + r * dim, dim, bits, out + r * rb);
}

void unpack_rows(const std::uint8_t* packed, std::size_t n, std::size_t dim, int bits, std::uint8_t* codes) {
  const std::size_t rb = row_bytes(dim, bits);
  for (std::size_t r = 0; r < n; ++r) unpack_row(packed + r * rb, dim, bits, codes + r * dim);
}

void encode_pack_rows(const float* const* rows, std::size_t n, std::size_t dim, const float* scale,
                      const float* zero, int bits, std::uint8_t* out) {
  const float levels = static_cast<float>((1u << bits) - 1u);
  const std::size_t rb = row_bytes(dim, bits);
  std::vector<std::uint8_t> codes(dim);
  for (std::size_t r = 0; r < n; ++r) {
    for (std::size_t c = 0; c < dim; ++c) {
      const float q = std::nearbyint((rows[r][c] - zero[c]) / scale[c]);  // half to even
      codes[c] = static_cast<std::uint8_t>(std::min(std::max(q, 0.0f), levels));
    }
    pack_row(codes.data(), dim, bits, out + r * rb);
  }
}

template <typename Out, typename Store>
void decode_rows(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                 const float* zero, int bits, Out* const* out_rows, Store store) {
  const std::size_t rb = row_bytes(dim, bits);
  std::vector<std::uint8_t> codes(dim);
  for (std::size_t r = 0; r < n; ++r) {
    unpack_row(packed + r * rb, dim, bits, codes.data());
    for (std::size_t c = 0; c < dim; ++c) {
      const float prod = static_cast<float>(codes[c]) * scale[c];
      out_rows[r][c] = store(prod + zero[c]);
    }
  }
}

void decode_rows_f16(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                     const float* zero, int bits, std::uint16_t* const* out_rows) {
  decode_rows(packed, n, dim, scale, zero, bits, out_rows, [](float v) { return f32_to_fp16(v); });
}
void decode_rows_f32(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                     const float* zero, int bits, float* const* out_rows) {
  decode_rows(packed, n, dim, scale, zero, bits, out_rows, [](float v) { return v; });
}

void make_params(const float* mn, const float* mx, std::size_t dim, int bits, std::uint16_t* scale_h,
                 std::uint16_t* zero_h, float* scale_f, float* zero_f) {
  const float levels = static_cast<float>((1u << bits) - 1u);
  for (std::size_t c = 0; c < dim; ++c) {
    const std::uint16_t z = f32_to_fp16(mn[c]);
    const float zf = fp16_to_f32(z);
    const float s = std::max((mx[c] - zf) / levels, 1e-8f);
    std::uint16_t sh = f32_to_fp16(s);
    if (fp16_to_f32(sh) < s) ++sh;    // next fp16 up (s > 0, so the bit pattern increases)
    if (sh > 0x7bffu) sh = 0x7bffu;   // only for 1-bit codes over a range above 65504
    zero_h[c] = z;
    scale_h[c] = sh;
    zero_f[c] = zf;
    scale_f[c] = fp16_to_f32(sh);
  }
}

void params_to_f32(const std::uint16_t* scale_h, const std::uint16_t* zero_h, std::size_t dim, float* scale_f,
                   float* zero_f) {
  for (std::size_t c = 0; c < dim; ++c) {
    scale_f[c] = fp16_to_f32(scale_h[c]);
    zero_f[c] = fp16_to_f32(zero_h[c]);
  }
}

void to_f32(const void* src, DType type, float* dst, std::size_t n) {
  switch (type) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::f16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(s[i]);
      return;
    }
    case DType::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
  }
}

void f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_fp16(src[i]);
}

std::size_t first_unrepresentable(const float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (!(std::fabs(x[i]) <= 65504.0f)) return i;  // NaN fails the comparison too
  }
  return n;
}

double sum_squares(const float* x, std::size_t n) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void row_norms_f16(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, double* out) {
  for (std::size_t r = 0; r < n; ++r) {
    double acc = 0;
    for (std::size_t c = 0; c < dim; ++c) {
      const double x = fp16_to_f32(rows[r][c]);
      acc += x * x;
    }
    out[r] = std::sqrt(acc);
  }
}

void rows_f16_to_f32(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, float* dst) {
  for (std::size_t r = 0; r < n; ++r) to_f32(rows[r], DType::f16, dst + r * dim, dim);
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{"scalar",    group_minmax, encode_pack_rows, decode_rows_f16,       decode_rows_f32,
                         pack_rows,   unpack_rows,  make_params,      params_to_f32,         to_f32,
                         f32_to_f16,  first_unrepresentable,          sum_squares,           row_norms_f16,
                         rows_f16_to_f32};
  return k;
}

}  // namespace kvslim::quant
