// Kernels of the group quantizer: encode + bit-pack rows, unpack + decode rows, group min/max,
// input conversion and checks. Two implementations with bit-identical results: a scalar reference
// (quant_reference.cc) and a SIMD one dispatched at run time through Highway (quant_simd.cc).
//
// Packed row layout (packed_row_bytes in kvslim/zipcache.h): a code of `bits` is split into
// power-of-two planes, widest first, taking the low bits first (7 = 4 + 2 + 1: bits 0-3, 4-5, 6).
// A plane of width p packs k = 8/p codes per byte "across the row": with m = ceil(D*p/8) bytes,
// byte i holds the codes of elements i, i+m, ..., i+(k-1)m (those < D) at bit offsets 0, p, ...
// so packing and unpacking are whole-vector shifts and ORs.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvslim/dtype.h"

namespace kvslim::quant {

struct Plane {
  int width = 0;  // 8, 4, 2 or 1 bits
  int shift = 0;  // which bits of the code this plane holds
};
// Planes of a `bits`-wide code (1..8); returns their count (<= 4).
inline int code_planes(int bits, Plane out[4]) {
  int n = 0, shift = 0;
  for (int p : {8, 4, 2, 1}) {
    if (bits & p) {
      out[n++] = Plane{p, shift};
      shift += p;
    }
  }
  return n;
}
inline std::size_t plane_bytes(std::size_t dim, int width) { return (dim * width + 7) / 8; }

struct Kernels {
  const char* name;
  // Per channel c < dim: mn[c] / mx[c] = min / max of rows[r][c] over r < n (n >= 1).
  void (*group_minmax)(const float* const* rows, std::size_t n, std::size_t dim, float* mn, float* mx);
  // Row r: code = clip(rint((x - zero) / scale), 0, 2^bits - 1), packed into
  // out + r * packed_row_bytes(dim, bits).
  void (*encode_pack_rows)(const float* const* rows, std::size_t n, std::size_t dim, const float* scale,
                           const float* zero, int bits, std::uint8_t* out);
  // Inverse: row r of packed codes -> fp16 code * scale + zero at out_rows[r]. code (8 bits) times an
  // fp16 scale (11-bit significand) is exact in fp32, so a compiler fusing the multiply-add cannot
  // change the result: every implementation rounds once, at the add.
  void (*decode_rows_f16)(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                          const float* zero, int bits, std::uint16_t* const* out_rows);
  void (*decode_rows_f32)(const std::uint8_t* packed, std::size_t n, std::size_t dim, const float* scale,
                          const float* zero, int bits, float* const* out_rows);
  // Bit packing alone (codes [n, dim] one byte each <-> packed rows), for tests and benchmarks.
  void (*pack_rows)(const std::uint8_t* codes, std::size_t n, std::size_t dim, int bits, std::uint8_t* out);
  void (*unpack_rows)(const std::uint8_t* packed, std::size_t n, std::size_t dim, int bits, std::uint8_t* codes);
  // Group parameters per channel c < dim (see kvslim/zipcache.h): zero = fp16(mn) (nearest),
  // scale = smallest fp16 >= max((mx - zero_f) / (2^bits - 1), 1e-8) (at most 65504); the stored
  // fp16 bits and their fp32 values.
  void (*make_params)(const float* mn, const float* mx, std::size_t dim, int bits, std::uint16_t* scale_h,
                      std::uint16_t* zero_h, float* scale_f, float* zero_f);
  // Stored fp16 parameters -> fp32.
  void (*params_to_f32)(const std::uint16_t* scale_h, const std::uint16_t* zero_h, std::size_t dim, float* scale_f,
                        float* zero_f);
  // dst = float(src) for n elements of `type`.
  void (*to_f32)(const void* src, DType type, float* dst, std::size_t n);
  // dst = fp16(src), round to nearest even.
  void (*f32_to_f16)(const float* src, std::uint16_t* dst, std::size_t n);
  // Index of the first element that is not finite or has |x| > 65504 (not representable in the
  // fp16 view); n if there is none.
  std::size_t (*first_unrepresentable)(const float* x, std::size_t n);
  // sum of x[i]^2 accumulated in double (summation order may differ between implementations).
  double (*sum_squares)(const float* x, std::size_t n);
  // out[r] = sqrt(sum of float(rows[r][c])^2 in double), fp16 rows (the key-norm saliency score).
  void (*row_norms_f16)(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, double* out);
  // dst + r * dim = float(rows[r]) for fp16 rows r < n.
  void (*rows_f16_to_f32)(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, float* dst);
};

const Kernels& scalar_kernels();
// The best SIMD implementation for this CPU (Highway dynamic dispatch).
const Kernels& simd_kernels();
// Name of the instruction set the SIMD kernels dispatch to on this machine.
const char* simd_target();

}  // namespace kvslim::quant
