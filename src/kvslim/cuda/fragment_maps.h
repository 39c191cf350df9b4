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
// kivi values through the fp16 tensor cores (mma.m16n8k16, fp32 sums; the keys take the int8 ones,
// InPlaceKeyMap below): a code masked in place into a 16-bit half whose exponent bits are zero IS
// an fp16 number -- the subnormal code * 2^o * 2^-24, o its bit offset in the half -- so one LOP3
// turns two codes into two halves, and one HMUL2 by normalizer(o) = 2^(14 - o) makes them
// code * 2^-10, a normal number, for every plane alike. (The tensor cores take subnormals, but
// align a product by its exponent field, not by its value: a subnormal code's product kept only
// ~13 - o bits -- 2-5e-4 of the output on H200, docs/benchmarks/cuda/device_s39/r1_tests.txt.)
// Only offsets o <= 10 - BITS are mantissa bits: a register takes its two codes from the low byte of
// each half; in the plane layout byte B holds channels B + j * RB at o = j * BITS.
// Values (A rows = channels, k = tokens): lane g reads BPLV bytes of each of its tokens at g BPLV;
// pair_bytes() puts byte b of two tokens' words into the two halves, and value register i =
// (byte i / NJ, plane i % NJ) of a token pair is channel value_channel(i, g): m-tile i / 2, row g
// (i even) or g + 8 (i odd).
template <int BITS, int D>
struct HalfCodeMap {
  static constexpr int RB = D * BITS / 8;  // packed row bytes
  static constexpr int NJ = 8 / BITS;      // planes (codes per byte)
  static constexpr int BPLV = RB / 8;      // value bytes per lane and token
  static constexpr int NWV = BPLV >= 4 ? BPLV / 4 : 1;  // value words per lane and token
  static constexpr int NC = D / 8;         // value channels per lane
  static constexpr int MT = D / 16;        // m-tiles of the value product
  static constexpr std::uint32_t MASK = ((1u << BITS) - 1u) * 0x00010001u;  // plane 0 of both halves' low bytes
  static_assert(BPLV * NJ == NC, "head_dim 64 or 128 with 2, 4 or 8 bits");

  // A normalised code is code * kCodeUnit (the value product's sums carry it until the output).
  static constexpr float kCodeUnit = 1.f / 1024.f;
  // 2^(14 - o) in both fp16 halves: a masked code (code * 2^(o - 24)) times it is code * kCodeUnit, exactly.
  KVSLIM_MAP_FN static std::uint32_t normalizer(int o) { return static_cast<std::uint32_t>(29 - o) * 0x04000400u; }
  // Byte b (0..3) of w0 into bits 0-7, of w1 into bits 16-23 (bits 8-15 and 24-31: masked off).
  KVSLIM_MAP_FN static std::uint32_t pair_bytes(std::uint32_t w0, std::uint32_t w1, int b) {
    return prmt(w0, w1, static_cast<std::uint32_t>(b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)));
  }
  KVSLIM_MAP_FN static int value_channel(int i, int g) { return g * BPLV + i / NJ + (i % NJ) * RB; }
  KVSLIM_MAP_FN static int value_shift(int i) { return (i % NJ) * BITS; }
  // xb[b] = pair_bytes of the lane's byte b (of its BPLV) of the two tokens.
  KVSLIM_MAP_FN static std::uint32_t value_reg(const std::uint32_t* xb, int i) {
    return xb[i / NJ] & (MASK << value_shift(i));
  }
};

// The order of a 32-row unit's tokens in the value product of attend_codes_half.cu. Lane t's j-th
// token of k-step ks (j 0, 1: k-slots 2t, 2t + 1; j 2, 3: k-slots 2t + 8, 2t + 9) is x + 8 j,
// x = 4 ks + t; the lane pairs those tokens' value-code rows (pair_bytes) and reads their P as one
// 8-byte word of the vector's 32 halves, at p_index(x). P of token `tok` lies at 4 (tok % 8) +
// tok / 8: the softmax lane (g, t), which holds tokens g + 8 j, writes them as one 8-byte word, and
// the 4 t lanes read neighbouring rows of codes. (Tokens 16 ks + 4t + j, stop 49's order, put the
// 4 t lanes' reads 4 rows apart, on the same banks, and took a store a row.)
struct HalfUnitOrder {
  KVSLIM_MAP_FN static int value_token(int ks, int t, int j) { return 4 * ks + t + 8 * j; }
  KVSLIM_MAP_FN static int p_index(int token) { return 4 * (token % 8) + token / 8; }
  static constexpr int kRowStride = 8;  // value_token(ks, t, j + 1) - value_token(ks, t, j)
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
