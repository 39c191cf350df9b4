// Internal entry points of the group quantizer for the caches: quantize a set given as row
// pointers (rows of a set need not be contiguous: the hi set of a block is scattered), decode a set
// straight into fp16 destination rows. Public wrappers are in kvslim/zipcache.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvslim/zipcache.h"
#include "quant/quant_kernels.h"

namespace kvslim::quant {

// Rows are finite and |x| <= 65504 (checked by the caller); n may be 0. fp16 rows are converted a
// group at a time into a small buffer, so the data is read from memory once.
GroupQuantized quantize_row_set(const float* const* rows, std::size_t n, std::size_t dim, int bits,
                                std::size_t group_size, const Kernels& k = simd_kernels());
GroupQuantized quantize_row_set(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, int bits,
                                std::size_t group_size, const Kernels& k = simd_kernels());
// Row r of the set -> out_rows[r] (fp16, dim elements).
void decode_set_f16(const GroupQuantized& q, std::uint16_t* const* out_rows, const Kernels& k = simd_kernels());
void decode_set_f32(const GroupQuantized& q, float* const* out_rows, const Kernels& k = simd_kernels());

// Mixed-precision block from rows (row pointers, S of them, fp32 or fp16) and a 0/1 mask.
ZipCompressed zip_compress_rows(const float* const* rows, std::size_t S, std::size_t dim,
                                const std::uint8_t* mask, int hi_bits, int lo_bits, std::size_t group_size,
                                const Kernels& k = simd_kernels());
ZipCompressed zip_compress_rows(const std::uint16_t* const* rows, std::size_t S, std::size_t dim,
                                const std::uint8_t* mask, int hi_bits, int lo_bits, std::size_t group_size,
                                const Kernels& k = simd_kernels());
// L2 norm of each fp16 row [S], accumulated in double (the key-norm saliency score).
std::vector<double> row_norms_f16(const std::uint16_t* const* rows, std::size_t S, std::size_t dim,
                                  const Kernels& k = simd_kernels());
// Block -> fp16 rows out + s * out_stride.
void zip_decode_f16(const ZipCompressed& z, std::uint16_t* out, std::size_t out_stride,
                    const Kernels& k = simd_kernels());

}  // namespace kvslim::quant
