// SIMD kernels of the attention a cache computes over its own storage (run-time dispatched through
// Highway, attend_simd.cc). Each reads the stored rows once and never widens a whole row set: fp16
// rows are promoted in registers, packed codes are unpacked a quantization group at a time into a
// small u8 tile (L1) and promoted in registers.
//
// Shapes: M query vectors q [M, D] fp32 (already multiplied by the logit scale); a score matrix
// [M, ld] fp32 with one column per row of the segment.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvslim::attend {

// logits[m * ld + r] = q[m] . float(keys[r * stride, :D]) for m < M, r < n.
void logits_f16(const float* q, std::size_t M, std::size_t D, const std::uint16_t* keys, std::size_t stride,
                std::size_t n, float* logits, std::size_t ld);
// logits[m * ld + col(r)] = q[m] . float(codes[r * D, :D]) + bias[m], col(r) = idx ? idx[r] : r.
void logits_codes(const float* q, std::size_t M, std::size_t D, const std::uint8_t* codes, std::size_t n,
                  const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld);
// acc[m * D + c] += sum_r p[m * ld + r] * float(values[r * stride + c]).
void accumulate_f16(const float* p, std::size_t ld, std::size_t M, const std::uint16_t* values, std::size_t stride,
                    std::size_t n, std::size_t D, float* acc);
// acc[m * D + c] += sum_r p[m * ld + r] * float(codes[r * D + c]).
void accumulate_codes(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* codes, std::size_t n,
                      std::size_t D, float* acc);
// Per quantization group (scale, zero [D]): qs[m] = q[m] * scale, bias[m] = q[m] . zero.
void scale_queries(const float* q, std::size_t M, std::size_t D, const float* scale, const float* zero, float* qs,
                   float* bias);
// acc[m] += scale * gacc[m] + zero * psum[m] (a group's value sum from its code sums).
void combine_group(const float* gacc, const float* psum, std::size_t M, std::size_t D, const float* scale,
                   const float* zero, float* acc);
// Packed codes read in place (no u8 tile): true when this target can do it for rows of D codes at
// `bits` (every bit plane a whole number of vectors long); else unpack + the *_codes kernels.
bool packed_direct(std::size_t D, int bits);
// As logits_codes / accumulate_codes, from packed rows (packed_row_bytes(D, bits) bytes each).
void logits_packed(const float* q, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits, std::size_t n,
                   const float* bias, const std::uint32_t* idx, float* logits, std::size_t ld);
void accumulate_packed(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                       std::size_t n, std::size_t D, float* acc);
// Integer dot products on packed codes (AVX-512 VNNI + VBMI; attend_int8.cc) for bits 2, 4 and 8
// with D * bits / 8 in {16, 32, 64} and D <= 256: whether they run here for rows of D codes at
// `bits` (and are enabled).
bool packed_int8_supported(std::size_t D, int bits);
// Scores of n packed rows in groups of group_size (the last may be shorter), group gi with fp16
// per-channel params scale_h[gi * D ..], zero_h[gi * D ..]: logits[m * ld + r] = (q[m] * scale) .
// codes[r] + q[m] . zero. Returns false (writing nothing) where packed_int8_supported is false;
// then scale_queries + logits_packed / logits_codes do it, group by group.
bool logits_packed_int8(const float* q, const std::uint16_t* scale_h, const std::uint16_t* zero_h,
                        std::size_t group_size, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits,
                        std::size_t n, float* logits, std::size_t ld);
// acc[m * D + c] += sum_r p[m * ld + r] * (code[r, c] * scale[c] + zero[c]) over the n packed rows,
// each group with its own fp16 params as above; false = not done (nothing written).
bool accumulate_packed_int8(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                            std::size_t n, std::size_t D, std::size_t group_size, const std::uint16_t* scale_h,
                            const std::uint16_t* zero_h, float* acc);
// A mixed block's scores in token order: out[m * ld + s] = token s salient (bit s of mask_bits) ?
// the next of hi[m * ld_hi ..] : the next of lo[m * ld_lo ..], s < n. False where the integer
// kernels do not run (nothing written).
bool merge_by_mask_int8(const float* hi, std::size_t ld_hi, const float* lo, std::size_t ld_lo,
                        const std::uint8_t* mask_bits, std::size_t M, std::size_t n, float* out, std::size_t ld);
// Whether the *_int8 kernels run here; tests turn it off to check the kernels it stands in for.
bool int8_logits_available();
void set_int8_logits_enabled(bool enabled);
// x[i] = exp(x[i] - shift) (exactly 0 where x[i] is -inf); returns the sum. shift is finite.
float exp_shift(float* x, std::size_t n, float shift);

// Largest of n >= 1 values (-inf for floats when all are -inf).
float max_f32(const float* x, std::size_t n);
std::int64_t max_i64(const std::int64_t* x, std::size_t n);

// The instruction set the kernels dispatch to now.
const char* target_name();

}  // namespace kvslim::attend
