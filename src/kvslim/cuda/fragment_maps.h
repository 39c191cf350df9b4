// Which channel (or token) each register of each lane carries in the attention kernels' tensor-core
// products (cuda_common.cuh has the mma fragment layout). Shared by the kernels (device) and by a
// host test that emulates a warp's mma to check every map (tests/kvslim/fragment_maps_test.cc), so
// the permutations are checked on any machine.
#pragma once
#include <cstdint>

#include "kvslim/dtype.h"
#ifdef __CUDACC__
#include <cuda_fp16.h>
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

// Two codes (bits 0.. and 16.. of x after masking) as the fp16 pair (c0, c1): 1024 + c is exact in
// fp16 for c < 1024, so OR-ing the code into 0x6400 and subtracting 1024 converts without I2F.
KVSLIM_MAP_FN std::uint32_t codes_to_half2(std::uint32_t x_masked) {
#ifdef __CUDA_ARCH__
  const std::uint32_t biased = x_masked | 0x64006400u;
  const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2(__half(1024.0f), __half(1024.0f)));
  return *reinterpret_cast<const std::uint32_t*>(&v);
#else
  const float lo = fp16_to_f32(static_cast<std::uint16_t>((x_masked & 0xffffu) | 0x6400u)) - 1024.f;
  const float hi = fp16_to_f32(static_cast<std::uint16_t>((x_masked >> 16) | 0x6400u)) - 1024.f;
  return static_cast<std::uint32_t>(f32_to_fp16(lo)) | (static_cast<std::uint32_t>(f32_to_fp16(hi)) << 16);
#endif
}

// ---------------------------------------------------------------------------------------------
// Channel maps. A lane's share of a row, and which channel each half of each register holds.

// kivi keys (B operand, lane t): bytes [t*RB/4, (t+1)*RB/4) of the packed row. Pair p = (word wi,
// code slot j, byte h); element e: channel i0 + h + 2e + j*RB with i0 = t*RB/4 + 4*wi (the CPU's
// plane layout: byte i holds channels i, i+RB, i+2RB, ... at bit offsets 0, bits, ...).
template <int BITS, int D>
struct PackedMap {
  static constexpr int RB = D * BITS / 8;    // packed row bytes
  static constexpr int NJ = 8 / BITS;        // codes per byte
  static constexpr int KW = RB / 16;         // key words per lane
  static constexpr int BPLV = RB / 8;        // value bytes per lane (lane g of a token row)
  static constexpr int VW = BPLV >= 4 ? BPLV / 4 : 1;
  static constexpr int XI = BPLV >= 4 ? 2 : 1;
  static constexpr std::uint32_t MASK2 = BITS == 8 ? 0u : ((1u << BITS) - 1u) * 0x00010001u;

  KVSLIM_MAP_FN static int key_channel(int p, int e, int t) {
    const int pw = 2 * NJ, wi = p / pw, r = p % pw, j = r / 2, h = r % 2;
    return t * (RB / 4) + 4 * wi + h + 2 * e + j * RB;
  }
  // Register of pair p from the lane's key words.
  KVSLIM_MAP_FN static std::uint32_t key_b(const std::uint32_t* w, int p) {
    const int pw = 2 * NJ, wi = p / pw, r = p % pw, j = r / 2, h = r % 2;
    if constexpr (BITS == 8) {
      return codes_to_half2(prmt(w[wi], 0u, h ? 0x4341u : 0x4240u));
    } else {
      return codes_to_half2((w[wi] >> (8 * h + j * BITS)) & MASK2);
    }
  }
  // Values (B operand, lane g = channel group n): bytes [n*BPLV, (n+1)*BPLV) of each token row.
  // n-tile nt = ((wi * XI + xi) * 2 + h) * NJ + j; channel n*BPLV + 4wi + 2xi + h + j*RB.
  KVSLIM_MAP_FN static int value_channel(int nt, int n) {
    const int j = nt % NJ, h = (nt / NJ) % 2, xi = (nt / (2 * NJ)) % XI, wi = nt / (2 * NJ * XI);
    return n * BPLV + 4 * wi + 2 * xi + h + j * RB;
  }
  // (token a, token b) codes of n-tile nt as an fp16 pair, from the two tokens' words.
  KVSLIM_MAP_FN static std::uint32_t value_b(const std::uint32_t* wa, const std::uint32_t* wb, int nt) {
    const int j = nt % NJ, h = (nt / NJ) % 2, xi = (nt / (2 * NJ)) % XI, wi = nt / (2 * NJ * XI);
    const std::uint32_t x = prmt(wa[wi], wb[wi], xi ? 0x7632u : 0x5410u);  // [a_k, a_k+1, b_k, b_k+1]
    if constexpr (BITS == 8) {
      return codes_to_half2(prmt(x, 0u, h ? 0x4341u : 0x4240u));
    } else {
      return codes_to_half2((x >> (8 * h + j * BITS)) & MASK2);
    }
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
