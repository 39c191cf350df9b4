// ZipCache-adapted building blocks: key-norm saliency, the asymmetric min/max group quantizer of
// seed-behaviour.md §4.2 with bit-packed codes, the mixed-precision block (hi + lo sets + mask), and
// the original system's byte accounting (§4.3). Pure functions, usable without a cache.
//
// Storage choices (what `resident_bytes()` counts):
// - codes are bit-packed at their width, row by row (see `packed_row_bytes`);
// - group parameters (scale, zero) are stored as fp16, as the original *accounts* them (its memory
//   holds fp32). The §4.2 grid is kept: zero = fp16(gmin) (nearest), scale = the smallest fp16 >=
//   max((gmax - zero) / levels, 1e-8), so every value of the group stays inside the code range and a
//   group of identical fp16 rows (any 1-row group included) is reconstructed exactly;
// - the mask is one bit per token, and absent when every token has the same precision.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvslim {

// L2 norm of each row of rows [S, D] (fp32), accumulated in double. Throws InputError on a
// non-finite value, naming its (row, column).
std::vector<double> token_key_norms(std::span<const float> rows, std::size_t S, std::size_t D);

// Saliency mask over S = norms.size() tokens: n_hi = clamp(ceil(S * hi_fraction), 0, S) computed
// in double; the tokens whose rank in a stable ascending sort of the norms is >= S - n_hi are
// salient (1), so ties at the threshold go to later indices. hi_fraction must be in [0, 1].
std::vector<std::uint8_t> saliency_mask(std::span<const double> norms, double hi_fraction);
// The n_hi above, alone.
std::size_t salient_count(std::size_t S, double hi_fraction);

// Bytes of one packed row of D codes at `bits` (1..8): the code is split into power-of-two bit
// planes (e.g. 3 = 2 + 1), each plane packed across the row; sum over planes of ceil(D*p/8).
std::size_t packed_row_bytes(std::size_t D, int bits);

// A set of n rows quantized in groups of `group_size` consecutive rows (§4.2).
struct GroupQuantized {
  std::size_t rows = 0, dim = 0, group_size = 0;
  int bits = 0;
  std::vector<std::uint8_t> codes;  // [rows, packed_row_bytes(dim, bits)] bit-packed codes
  std::vector<std::uint16_t> scale;  // fp16 [groups, dim] step per group and channel
  std::vector<std::uint16_t> zero;   // fp16 [groups, dim] group minimum per channel

  std::size_t groups() const { return group_size == 0 ? 0 : (rows + group_size - 1) / group_size; }
  // Bytes really allocated by this set (capacities of its buffers).
  std::size_t resident_bytes() const;
};

// Quantizes rows [n, D] (fp32, finite, |x| <= 65504) at `bits` (1..8) in groups of `group_size`
// rows. Throws std::invalid_argument on bad arguments and InputError on bad values.
GroupQuantized quantize_groups(std::span<const float> rows, std::size_t n, std::size_t D, int bits,
                               std::size_t group_size);
// Reconstruction x^ = code * scale + zero, fp32 [n, D].
std::vector<float> dequantize_groups(const GroupQuantized& q);

// One block of S tokens compressed at mixed precision: salient rows at hi_bits, the rest at lo_bits,
// each set quantized on its own with groups of consecutive rows *within the set* (§4.2).
struct ZipCompressed {
  std::size_t seq_len = 0, head_dim = 0, group_size = 0;
  std::size_t n_hi = 0;
  std::vector<std::uint8_t> mask_bits;  // [ceil(S/8)] bit s = token s is salient; empty when n_hi is 0 or S
  GroupQuantized hi, lo;                // hi: [n_hi, D] at hi_bits, lo: [S - n_hi, D] at lo_bits

  bool salient(std::size_t s) const;
  std::vector<std::uint8_t> mask() const;  // [S] 0/1
  std::size_t resident_bytes() const;      // mask + both sets, as allocated
};

// Compresses rows [S, D] with key-norm saliency (token_key_norms + saliency_mask).
ZipCompressed zip_compress(std::span<const float> rows, std::size_t S, std::size_t D, int hi_bits,
                           int lo_bits, double hi_fraction, std::size_t group_size);
// Same with an explicit mask [S] (0/1), e.g. from attention scores.
ZipCompressed zip_compress_masked(std::span<const float> rows, std::size_t S, std::size_t D,
                                  std::span<const std::uint8_t> mask, int hi_bits, int lo_bits,
                                  std::size_t group_size);
// fp16 [S, D]: both sets dequantized and scattered back to their token positions.
std::vector<std::uint16_t> zip_reconstruct(const ZipCompressed& z);
// Into a caller's buffer: out fp16 rows, row s at out + s * out_stride (elements).
void zip_reconstruct_into(const ZipCompressed& z, std::uint16_t* out, std::size_t out_stride);

// §4.3, the original's accounting: codes "as if packed", fp16-sized scale + zero per group and
// channel (0 for an empty set), one byte per token of mask.
std::size_t zipcache_accounted_bytes(std::size_t n_hi, std::size_t n_lo, std::size_t S, std::size_t D,
                                     int hi_bits, int lo_bits, std::size_t group_size);
// §4.3 uniform baseline: ceil(S*D*bits/8) + ceil(S/gs)*D*4 (no mask).
std::size_t base_only_bytes(std::size_t S, std::size_t D, int bits, std::size_t group_size);

}  // namespace kvslim
