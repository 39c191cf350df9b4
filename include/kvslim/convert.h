// Bulk element conversions (SIMD, best instruction set chosen at run time through Highway).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvslim/dtype.h"

namespace kvslim {

// dst[i] = float(src[i]) for n elements of type `type` (f16, bf16 or f32).
void convert_to_f32(const void* src, DType type, float* dst, std::size_t n);
// dst[i] = fp16(src[i]), round to nearest even.
void convert_f32_to_fp16(const float* src, std::uint16_t* dst, std::size_t n);
// dst[i] = float(fp16 src[i]).
void convert_fp16_to_f32(const std::uint16_t* src, float* dst, std::size_t n);
// fp16 of any input type (f16 copied, bf16/f32 rounded to nearest even).
void convert_to_fp16(const void* src, DType type, std::uint16_t* dst, std::size_t n);

// Dot products of `n` fp16 rows of length d (row stride `stride` elements) with an fp32 query:
// out[i] = sum_j float(rows[i*stride + j]) * q[j]. The scoring pass of H2O and of attention.
void dot_fp16_rows(const std::uint16_t* rows, std::size_t n, std::size_t d, std::size_t stride,
                   const float* q, float* out);
// out[j] += w * float(row[j]) for j < d (the value-accumulation pass of attention).
void axpy_fp16_row(float w, const std::uint16_t* row, std::size_t d, float* out);

// Name of the instruction set the dispatcher picked on this machine (e.g. "AVX3", "AVX2").
const char* simd_target_name();
// How KVCache::attend reads kivi / zipcache codes here: "int8 dot products (AVX-512 VNNI + VBMI)"
// for 2/4/8-bit codes at head dims whose rows are 16/32/64 bytes, else "fp32 kernels (<target>)".
// Decode speed of the compressed caches depends on it.
const char* attend_packed_kernels();

}  // namespace kvslim
