// Matrix-vector products over ggml's block-quantized weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; block
// layouts in engine/gguf.h), read as stored: decode never expands a weight matrix to fp32.
//
// As llama.cpp does, the activation x is quantized once per product to int8 blocks of 32 values
// (Q8Blocks: scale d = max|x| / 127, q = round(x / d), kept with the per-block code sums), and each
// weight row is a sum of integer dot products (unsigned weight codes x signed activation codes:
// AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw` + `vpmaddwd`), each scaled by the weight block's
// and the activation block's scales in fp32. The activation is rounded as llama.cpp rounds it for
// the weight type (activation_format: q8_0, or q8_K's one scale per 256 values for the K-quants);
// every 32 codes carry their scale, so the kernels take any of the formats.
//
// SIMD through Highway with run-time dispatch (quant_gemv.cc): AVX3_DL (VNNI), AVX3 and AVX2 run
// x86 integer kernels; the other targets a portable loop. tests/engine/quant_gemv_test.cc checks
// every target this machine has against a double-precision reference over the dequantized blocks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/safetensors.h"

namespace kvslim::engine::qgemv {

enum class ActivationFormat { fine, q8_0, q8_k };  // described at quantize_activation

// x as int8 blocks of 32 (n a multiple of 32).
struct Q8Blocks {
  std::size_t n = 0;
  std::vector<std::int8_t> q;     // [n] codes in -127..127
  std::vector<float> d;           // [n / 32] scale of each block: x ~ q * d
  std::vector<float> ds;          // [n / 32] d * (sum of the block's 32 codes)
  std::vector<std::int32_t> s16;  // [n / 16] sum of each 16 codes (Q6_K's sub-blocks)
  // The codes rearranged for the AVX-512 Q4_0 / Q4_K kernels, which take 64 nibbles per load:
  // q_nib0 [n / 128 * 128]: per 4 blocks, the first halves of the 4 blocks, then their second
  // halves (q_4g[0:16], .., q_4g+3[0:16], q_4g[16:32], .., q_4g+3[16:32]);
  // q_nibk [n / 256 * 256]: per 256 values the 32-value blocks in the order 0 2 1 3 4 6 5 7.
  std::vector<std::int8_t> q_nib0, q_nibk;
  // How the codes were rounded (quantize_activation's `format`, described below). The Q4_Kx16 /
  // Q6_Kx16 kernels need q8_k, whose one scale per 256 values lets them sum a super-block's sub-blocks in
  // int32 with the weight's integer sub-block scales, as llama.cpp's K-quant kernels do.
  ActivationFormat format = ActivationFormat::fine;
};
// How the activation is rounded to int8 (the kernels take any of them but Q4_Kx16's and Q6_Kx16's,
// which need q8_k: each 32 values carry their scale). q8_0 / q8_k are llama.cpp's CPU formats (ggml's quantize_row_q8_0 on x86: codes from
// 127 / max|x|, the scale stored as fp16; quantize_row_q8_K_ref: one scale per 256 values, from the
// signed value of largest magnitude), so that kvslim's int8 products over a GGUF's blocks are
// llama.cpp's, up to the order of the fp32 sums; fine: one fp32 scale per 32 values (the least
// rounding, for tests and comparisons).
// The format llama.cpp pairs with a weight type: q8_0 for Q8_0 / Q4_0, q8_K for the K-quants.
ActivationFormat activation_format(WeightType type);
// Quantizes x[n] into `out` (its buffers grow as needed, never shrink: no allocation once warm);
// n a multiple of 32 (256 for q8_k).
// SIMD (Highway, run-time dispatch); the codes, scales and sums are exactly those of
// quantize_activation_reference (a scalar loop kept for the tests).
void quantize_activation(const float* x, std::size_t n, Q8Blocks& out, ActivationFormat format = ActivationFormat::fine);
void quantize_activation_reference(const float* x, std::size_t n, Q8Blocks& out, ActivationFormat format);

// y[r] = dot(row r of w, x) for r in [r0, r1). w: `type`'s blocks, rows of `row_bytes` bytes
// holding `cols` values (a multiple of the type's block size); x.n == cols. Q4_Kx16 / Q6_Kx16 take
// only a q8_k activation (std::invalid_argument otherwise; so does gemm_rows).
void gemv_rows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks& x, float* y,
               std::size_t r0, std::size_t r1);

// Prefill's product over several tokens: y[t * ldy + r] = dot(row r, xs[t]) for t < n, r in
// [r0, r1). On AVX-512 VNNI (gemm_is_packed()) 16 rows at a time are repacked into unsigned codes
// with a scale and offset per 16 values, and each vpdpbusd advances 16 rows of one token; elsewhere
// it is gemv_rows per token.
void gemm_rows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks* xs, std::size_t n,
               float* y, std::size_t ldy, std::size_t r0, std::size_t r1);
bool gemm_is_packed();

// n values of `type` (whole blocks) decoded to fp32 with SIMD: the same values as gguf::to_float.
// Throws std::invalid_argument for an interleaved type (Q4_0x16, Q4_Kx16, Q6_Kx16), whose rows are
// not contiguous.
void dequantize(WeightType type, const void* src, float* dst, std::size_t n);
// Rows [r0, r0 + nr) of the matrix at w (`cols` values per row, any block type including the
// interleaved ones) as fp32, row-major.
void dequantize_rows(WeightType type, const void* w, std::size_t cols, std::size_t r0, std::size_t nr, float* dst);

// Interleaved types: a matrix repacked so that decode's kernel reads 16 rows in one pass over the
// activation, their sums in the lanes of one vector, with no horizontal sum per row and one
// sequential weight stream per thread (as llama.cpp's repacked layouts; kvslim's own layouts and
// kernels). Per group of 16 rows, per block (Q4_0: 32 values) or super-block (Q4_K: 256) one unit:
// - Q4_0x16 (from Q4_0, the same bytes rearranged): a 288-byte unit = the 16 fp16 scales, then 4
//   chunks of 64 bytes, chunk c = [row 0..15][the row's code bytes 4c..4c+3] (low nibbles: values
//   4c..4c+3, high: 16+4c..16+4c+3).
// - Q4_Kx16 (from Q4_K): a 2368-byte unit (148 bytes a row against Q4_K's 144) = the 16 fp16 d
//   (32 bytes), the 16 fp16 dmin (32), the 8 six-bit sub-block scales unpacked to bytes as [j][row]
//   (128), the 8 mins likewise (128), then per pair p of sub-blocks (2p in the low nibbles, 2p+1 in
//   the high ones, as Q4_K stores them) 8 chunks of 64 bytes, chunk c = [row 0..15][the row's code
//   bytes 32p+4c..32p+4c+3]. The unpacked scales feed the kernels' int32 multiplies directly.
// - Q6_Kx16 (from Q6_K, as many bytes): a 3360-byte unit = the 16 fp16 d, the 16 int8 scales of
//   each 16-value group as [group][row] (256), then per half h (128 values) and c = 0..7 three
//   chunks X0, X1, X2 of 64 bytes [row 0..15][4 bytes]: byte k of a row's 4 in Xj holds the 6-bit
//   code of value 128h + 32j + 4c + k in bits 0-5 and bits 2j, 2j+1 of the code of value
//   128h + 96 + 4c + k in bits 6-7 (Q6_K's ql / qh split regrouped: one AND per code vector for
//   three quarters of the codes).
// The K-quant forms take only a q8_k activation: their kernels sum a super-block in int32.
// gemv_rows, gemm_rows and dequantize_rows take the matrix base (row_bytes unused).

// The interleaved type a matrix of `type` is repacked into at load, or `type` when there is none.
WeightType interleaved_type(WeightType type);
// Repacks rows[r] (row r's blocks of `type`; n_rows a multiple of 16, cols of the block size) into
// interleaved_type(type) at out (weight_bytes(interleaved_type(type), cols) * n_rows bytes).
// Throws std::invalid_argument for a type without an interleaved form or a shape that is not whole
// 16-row groups.
void interleave(WeightType type, const std::uint8_t* const* rows, std::size_t n_rows, std::size_t cols, std::uint8_t* out);
// Row r of an interleaved matrix back in its original type's blocks (the bytes interleave read).
void deinterleave_row(WeightType type, const void* w, std::size_t cols, std::size_t r, std::uint8_t* out);

// The Highway target gemv_rows runs on ("AVX3_DL", "AVX2", ...).
const char* target_name();

}  // namespace kvslim::engine::qgemv
