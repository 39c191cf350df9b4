// Which channel (or token) each register of each lane carries in the attention kernels' tensor-core
// products (cuda_common.cuh has the mma fragment layout). Shared by the kernels (device) and by a
// host test that emulates a warp's mma to check every map (tests/kvslim/fragment_maps_test.cc), so
// the permutations are checked on any machine.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvslim/dtype.h"
#ifdef __CUDACC__
#define KVSLIM_MAP_FN __host__ __device__ __forceinline__
#else
#define KVSLIM_MAP_FN inline
#endif

namespace kvslim::cuda {

// PRMT: byte i of the result = byte (sel >> 4i) & 7 of {a (bytes 0-3), b (bytes 4-7)}.
KVSLIM_MAP_FN std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const std::uint64_t x = (static_cast<std::uint64_t>(b) << 32) | a;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<std::uint32_t>((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
#endif
}

// ---------------------------------------------------------------------------------------------
// kivi codes through the int8 tensor cores (mma.m16n8k32: u8 codes times an s8 operand, s32 sums).
// The CPU's plane layout: byte i of a packed row of RB bytes holds channels i + j*RB (plane j) at
// bit offset j*BITS, so masking a 32-bit word of the row with one plane's bits gives four
// consecutive channels as four u8 codes -- an mma register as it is, no conversion.
//
// Keys are the A operand (rows = tokens): lane t reads bytes [t*RB/4, (t+1)*RB/4) of a token's row
// (KW words); key register r = (plane r / KW, word r % KW) holds channels key_channel(r, 0..3, t),
// and is k-step r / 2, slot r % 2 (slot 0 = k 4t..4t+3, slot 1 = k 16+4t..16+4t+3).
// Values are the A operand too (rows = channels, k = tokens): lane g reads bytes
// [g*BPLV, (g+1)*BPLV) of each of its 4 tokens, the bytes are transposed so that a register holds one
// byte position of the 4 tokens, and value register i = channel value_channel(i, g); m-tile i / 2,
// row g (i even) or g + 8 (i odd).
template <int BITS, int D>
struct CodeMap {
  static constexpr int RB = D * BITS / 8;   // packed row bytes
  static constexpr int NJ = 8 / BITS;       // planes (codes per byte)
  static constexpr int KW = RB / 16;        // key words per lane and token
  static constexpr int NR = KW * NJ;        // key registers per token (= D / 16)
  static constexpr int KS = D / 32;         // k-steps of the key product
  static constexpr int BPLV = RB / 8;       // value bytes per lane and token
  static constexpr int NWV = BPLV >= 4 ? BPLV / 4 : 1;  // value words per lane and token
  static constexpr int NC = BPLV * NJ;      // value channels per lane (= D / 8)
  static constexpr std::uint32_t MASK = BITS == 8 ? 0xffffffffu : ((1u << BITS) - 1u) * 0x01010101u;
  static_assert(NR == D / 16 && NC == D / 8 && KW >= 1, "head_dim 64 or 128 with 2, 4 or 8 bits");

  KVSLIM_MAP_FN static int key_channel(int r, int e, int t) { return (r / KW) * RB + t * (RB / 4) + 4 * (r % KW) + e; }
  KVSLIM_MAP_FN static std::uint32_t key_reg(const std::uint32_t* w, int r) { return (w[r % KW] >> (BITS * (r / KW))) & MASK; }
  KVSLIM_MAP_FN static int value_channel(int i, int g) { return (i / BPLV) * RB + g * BPLV + i % BPLV; }
  // x[b] = byte b of the lane's share of 4 tokens, gathered (gather_quad).
  KVSLIM_MAP_FN static std::uint32_t value_reg(const std::uint32_t* x, int i) {
    return (x[i % BPLV] >> (BITS * (i / BPLV))) & MASK;
  }
};

// ---------------------------------------------------------------------------------------------
// s8 operands as balanced base-256 digits. round(x * inv) plus 0x808080 has the digits
// + 128 as its bytes -- adding 128 to every digit of v = 65536 hi + 256 mid + lo (each in
// [-128, 127]) is adding 0x808080 -- so an FMA with a magic constant, one add, byte permutes
// and one XOR with 0x80808080 per register give the mma's s8 registers.

KVSLIM_MAP_FN std::int32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_int(f);
#else
  std::int32_t i;
  std::memcpy(&i, &f, 4);
  return i;
#endif
}

// round(x * inv) + 0x808080 for |x * inv| <= 2^22 (1.5 * 2^23 leaves the integer in the low bits).
KVSLIM_MAP_FN std::uint32_t biased_digits3(float x, float inv) {
  return static_cast<std::uint32_t>(float_bits(fmaf(x, inv, 12582912.f)) - 0x4B400000 + 0x808080);
}
// Digits 0 (lo), 1 (mid), 2 (hi) of four biased values, each as one s8 register.
KVSLIM_MAP_FN void pack_digits3(std::uint32_t u0, std::uint32_t u1, std::uint32_t u2, std::uint32_t u3,
                                std::uint32_t& lo, std::uint32_t& mid, std::uint32_t& hi) {
  const std::uint32_t a = prmt(u0, u1, 0x5140u), b = prmt(u2, u3, 0x5140u);  // bytes 0, 1 interleaved
  lo = prmt(a, b, 0x5410u) ^ 0x80808080u;
  mid = prmt(a, b, 0x7632u) ^ 0x80808080u;
  hi = prmt(prmt(u0, u1, 0x0062u), prmt(u2, u3, 0x0062u), 0x5410u) ^ 0x80808080u;
}

// x[4 wi + b] = [byte b of word wi of tokens 0, 1, 2, 3] from w0..w3 = the 4 tokens' words wi.
KVSLIM_MAP_FN void gather_quad(std::uint32_t w0, std::uint32_t w1, std::uint32_t w2, std::uint32_t w3, int bytes,
                               std::uint32_t* x) {
  const std::uint32_t a = prmt(w0, w1, 0x5140u), b = prmt(w2, w3, 0x5140u);  // bytes 0, 1 interleaved
  x[0] = prmt(a, b, 0x5410u);
  x[1] = prmt(a, b, 0x7632u);
  if (bytes > 2) {
    const std::uint32_t c = prmt(w0, w1, 0x7362u), d = prmt(w2, w3, 0x7362u);  // bytes 2, 3
    x[2] = prmt(c, d, 0x5410u);
    x[3] = prmt(c, d, 0x7632u);
  }
}

// ---------------------------------------------------------------------------------------------
// kivi values of the decode codes kernel (attend_codes_half.cu) through the int8 tensor cores
// (mma.m16n8k32: u8 codes times s8 digits of P, s32 sums): the codes left where they lie, as the
// keys are (InPlaceKeyMap below), and P as two balanced s8 digits relative to the unit's largest P
// of each query vector. One LOP3 masks 4 codes (4 tokens of one channel, code * 2^(BITS * plane));
// the plane's power of two is taken off with the group's scale, once a group.
// A (rows = channels, k = tokens): k-slot 4 kb + j is token kb + 8 j (HalfUnitOrder), so lane (g, t)
// reads BPLV bytes at g BPLV of the tokens of k-blocks t and t + 4; gather_quad puts byte b of its
// 4 tokens into one word, and value register i = (byte i / NJ, plane i % NJ) of it is channel
// value_channel(i, g): m-tile i / 2, row g (i even) or g + 8 (i odd).
// B (P's digits, column 2v = vector v's hi digits, 2v + 1 its lo digits): the softmax lane (g, t),
// which holds tokens g + 8 j of vector t, writes k-block g of columns 2t and 2t + 1 (pack_p_digits),
// one word each at p_word(column, g); lane (g, t) reads column g's k-blocks t and t + 4 as one
// 8-byte word at p_word(g, t). C: lane (g, t) holds vector t's hi and lo sums of rows g and g + 8.
template <int BITS, int D>
struct HalfCodeMap {
  static constexpr int RB = D * BITS / 8;  // packed row bytes
  static constexpr int NJ = 8 / BITS;      // planes (codes per byte)
  static constexpr int BPLV = RB / 8;      // value bytes per lane and token
  static constexpr int NWV = BPLV >= 4 ? BPLV / 4 : 1;  // value words per lane and token
  static constexpr int NC = D / 8;         // value channels per lane
  static constexpr int MT = D / 16;        // m-tiles of the value product
  static constexpr std::uint32_t MASK = BITS == 8 ? 0xffffffffu : ((1u << BITS) - 1u) * 0x01010101u;  // plane 0 of 4 bytes
  static_assert(BPLV * NJ == NC, "head_dim 64 or 128 with 2, 4 or 8 bits");

  // The value sums carry kCodeUnit until the output (one multiply a group for P's sum, not a channel).
  static constexpr float kCodeUnit = 1.f / 1024.f;
  KVSLIM_MAP_FN static int value_channel(int i, int g) { return g * BPLV + i / NJ + (i % NJ) * RB; }
  KVSLIM_MAP_FN static int value_shift(int i) { return (i % NJ) * BITS; }
  // x[b] = byte b (of the lane's BPLV) of 4 tokens (gather_quad): register i, code << value_shift(i).
  KVSLIM_MAP_FN static std::uint32_t value_reg(const std::uint32_t* x, int i) {
    return x[i / NJ] & (MASK << value_shift(i));
  }

  // P' in [0, 1] as v = round(P' kDigitRange) = 256 hi + lo, hi in [0, 127], lo in [-128, 127]:
  // fmaf(P', R, 1.5 * 2^23 + 128) leaves v + 128 in the float's low 16 bits (byte 1 = hi, byte 0 =
  // lo + 128).
  static constexpr float kDigitRange = 32512.f;   // 127 * 256
  static constexpr float kDigitBias = 12583040.f;  // 1.5 * 2^23 + 128
  // kDigitBias + v: the float whose bits are the digits (its low 16 bits), and whose value less the
  // bias is v exactly (an integer below 2^24) -- the weight the value product gives P'.
  KVSLIM_MAP_FN static float digit_float(float p) { return fmaf(p, kDigitRange, kDigitBias); }
  KVSLIM_MAP_FN static std::uint32_t biased_p_digits(float p) {
    return static_cast<std::uint32_t>(float_bits(digit_float(p)));
  }
  // The hi and lo digit words of 4 tokens (byte j = u[j]'s digits).
  KVSLIM_MAP_FN static void pack_p_digits(std::uint32_t u0, std::uint32_t u1, std::uint32_t u2, std::uint32_t u3,
                                          std::uint32_t& hi, std::uint32_t& lo) {
    const std::uint32_t a = prmt(u0, u1, 0x5140u), b = prmt(u2, u3, 0x5140u);  // bytes 0, 1 interleaved
    lo = prmt(a, b, 0x5410u) ^ 0x80808080u;
    hi = prmt(a, b, 0x7632u);
  }
  // P's digit word of B column `col` (0..7), k-block kb (0..7): kb and kb + 4 side by side.
  KVSLIM_MAP_FN static int p_word(int col, int kb) { return col * 8 + (kb % 4) * 2 + kb / 4; }
};

// The order of a 32-row unit's tokens in the value product of attend_codes_half.cu: k-slot 4 kb + j
// is token value_token(kb, j) = kb + 8 j. The softmax lane (g, t) holds tokens g + 8 j -- k-block g
// whole, one word of digits a column -- and the 4 t lanes of a g read neighbouring rows of codes.
struct HalfUnitOrder {
  KVSLIM_MAP_FN static int value_token(int kb, int j) { return kb + 8 * j; }
  static constexpr int kRowStride = 8;  // value_token(kb, j + 1) - value_token(kb, j)
};

// kivi keys through the int8 tensor cores with the codes left where they lie (the decode codes
// kernel's keys, attend_codes_half.cu): CodeMap's key register r masked in place,
// without its shift, so its bytes are code * 2^(BITS * plane(r)) -- one LOP3 for 4 codes. The query
// side compensates: channel c of register r takes the integer round(q'_c / max|q'| * 2^scale_bits(r))
// as four balanced s8 digits (q_digits), so every product is code * q'_c / max|q'| * 2^kTotalBits
// to within the rounding of the worst plane's 2^-kFixedBits (the int8 kernel's three digits').
// Digits 3, 2 of a vector go to columns 2v, 2v + 1 of one mma, digits 1, 0 to those of a second;
// each column's sum stays below 2^22 (128 channels * 255 * 128), the int8 kernel's sum_of range.
template <int BITS, int D>
struct InPlaceKeyMap {
  using Map = CodeMap<BITS, D>;
  static constexpr int kFixedBits = 22;
  static constexpr int kTotalBits = kFixedBits + BITS * (Map::NJ - 1);  // <= 28: four s8 digits hold it
  KVSLIM_MAP_FN static int plane(int r) { return r / Map::KW; }
  KVSLIM_MAP_FN static std::uint32_t key_reg(const std::uint32_t* w, int r) {
    return w[r % Map::KW] & (Map::MASK << (BITS * plane(r)));
  }
  KVSLIM_MAP_FN static int scale_bits(int r) { return kFixedBits + BITS * (Map::NJ - 1 - plane(r)); }
  // x: the 4 channels key_channel(r, 0..3, t) of q' / max|q'| (in [-1, 1]); d[i]: digit i of each
  // (channel e in byte e), s8.
  KVSLIM_MAP_FN static void q_digits(const float x[4], int r, std::uint32_t d[4]) {
    const float scale = static_cast<float>(1u << scale_bits(r));  // exact: x * scale only moves the exponent
    const float y[4] = {x[0] * scale, x[1] * scale, x[2] * scale, x[3] * scale};
    scaled_q_digits(y, d);
  }
  // The same from y = x * 2^scale_bits(r) (the kernel scales 1 / max|q'| by it once a register:
  // the same bits, x * 2^k being exact).
  KVSLIM_MAP_FN static void scaled_q_digits(const float y[4], std::uint32_t d[4]) {
    std::uint32_t u[4];
    for (int e = 0; e < 4; ++e) {
#ifdef __CUDA_ARCH__
      const int v = __float2int_rn(y[e]);
#else
      const int v = static_cast<int>(std::nearbyint(y[e]));  // round to nearest even, as rn
#endif
      u[e] = static_cast<std::uint32_t>(v) + 0x80808080u;  // balanced digits + 128 in each byte (|v| < 2^30)
    }
    gather_quad(u[0], u[1], u[2], u[3], 4, d);
    for (int i = 0; i < 4; ++i) d[i] ^= 0x80808080u;
  }
};

// Dense rows. Keys (lane t): 16-byte chunks 4c + t of the row, c < D/32; pair p = 4c + wi holds
// channels (4c + t)*8 + 2wi + {0, 1} -- the loaded words are the B registers as they are.
// Values (lane g = n): chunks n + 8c, c < D/64; n-tile nt = (c*4 + wi)*2 + e: channel (n + 8c)*8 + 2wi + e.
template <int D>
struct DenseMap {
  KVSLIM_MAP_FN static int key_channel(int p, int e, int t) { return (4 * (p / 4) + t) * 8 + 2 * (p % 4) + e; }
  KVSLIM_MAP_FN static int value_channel(int nt, int n) {
    const int e = nt % 2, wi = (nt / 2) % 4, c = nt / 8;
    return (n + 8 * c) * 8 + 2 * wi + e;
  }
};

}  // namespace kvslim::cuda
