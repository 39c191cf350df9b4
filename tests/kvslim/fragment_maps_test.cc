// The CUDA attention kernels feed packed codes and fp16 rows to the tensor cores in the order they
// lie in memory, so each lane's registers hold a permutation of channels (src/kvslim/cuda/
// fragment_maps.h). This emulates one warp's mma.m16n8k16 on the host, with the fragment layout of
// the PTX ISA, and checks that every map gives exactly q . k for every token and P . V for every
// channel -- on any machine, GPU or not.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "cuda/fragment_maps.h"
#include "kvslim/dtype.h"
#include "quant/quant_kernels.h"

namespace kvslim::cuda {
namespace {

float half_of(std::uint32_t reg, int e) { return fp16_to_f32(static_cast<std::uint16_t>(e ? reg >> 16 : reg & 0xffffu)); }
std::uint32_t pack(float lo, float hi) {
  return static_cast<std::uint32_t>(f32_to_fp16(lo)) | (static_cast<std::uint32_t>(f32_to_fp16(hi)) << 16);
}
std::uint32_t load32(const std::uint8_t* p, int bytes = 4) {
  std::uint32_t w = 0;
  std::memcpy(&w, p, bytes);
  return w;
}

// C[16][8] += A[16][16] B[16][8] from per-lane fragments (a[lane][4], b[lane][2]).
void emulate_mma(const std::uint32_t a[32][4], const std::uint32_t b[32][2], double C[16][8]) {
  double A[16][16] = {}, B[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = half_of(a[lane][0], e);
      A[g + 8][2 * t + e] = half_of(a[lane][1], e);
      A[g][2 * t + 8 + e] = half_of(a[lane][2], e);
      A[g + 8][2 * t + 8 + e] = half_of(a[lane][3], e);
      B[2 * t + e][g] = half_of(b[lane][0], e);
      B[2 * t + 8 + e][g] = half_of(b[lane][1], e);
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 16; ++k) C[r][n] += A[r][k] * B[k][n];
}

template <int BITS, int D>
void check_packed() {
  using Map = PackedMap<BITS, D>;
  constexpr int RB = Map::RB, KS = D / 16;
  std::mt19937 rng(BITS * 1000 + D);
  // 16 tokens of codes, packed as the CPU packs them.
  std::vector<std::uint8_t> codes(16 * D), packed(16 * RB);
  for (auto& c : codes) c = static_cast<std::uint8_t>(rng() % (1u << BITS));
  quant::scalar_kernels().pack_rows(codes.data(), 16, D, BITS, packed.data());
  // Query rows q[8][D] and probabilities P[8][16]: small integers, so fp16 and the sums are exact.
  std::vector<float> q(8 * D), P(8 * 16);
  for (auto& x : q) x = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  for (auto& x : P) x = static_cast<float>(rng() % 5);

  // Keys: S^T[row][token] over the first 8 tokens.
  double C[16][8] = {};
  for (int ks = 0; ks < KS; ++ks) {
    std::uint32_t a[32][4], b[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      std::uint32_t w[Map::KW];
      for (int i = 0; i < Map::KW; ++i) w[i] = load32(packed.data() + g * RB + t * (RB / 4) + 4 * i);
      b[lane][0] = Map::key_b(w, 2 * ks);
      b[lane][1] = Map::key_b(w, 2 * ks + 1);
      const auto qv = [&](int p, int e) { return q[g * D + Map::key_channel(p, e, t)]; };
      a[lane][0] = pack(qv(2 * ks, 0), qv(2 * ks, 1));
      a[lane][1] = 0;
      a[lane][2] = pack(qv(2 * ks + 1, 0), qv(2 * ks + 1, 1));
      a[lane][3] = 0;
    }
    emulate_mma(a, b, C);
  }
  for (int r = 0; r < 8; ++r) {
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int c = 0; c < D; ++c) want += q[r * D + c] * codes[n * D + c];
      ASSERT_EQ(C[r][n], want) << "keys bits " << BITS << " D " << D << " row " << r << " token " << n;
    }
  }
  // Every lane's channels, over t, cover each channel once.
  std::multiset<int> seen;
  for (int t = 0; t < 4; ++t)
    for (int p = 0; p < D / 8; ++p)
      for (int e = 0; e < 2; ++e) seen.insert(Map::key_channel(p, e, t));
  for (int c = 0; c < D; ++c) ASSERT_EQ(seen.count(c), 1u) << "key channel " << c;

  // Values: O[row][channel] = sum_k P[row][k] code[k][channel], n-tile by n-tile.
  std::multiset<int> vseen;
  for (int nt = 0; nt < D / 8; ++nt) {
    std::uint32_t a[32][4], b[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      std::uint32_t vw[4][Map::VW];
      for (int qq = 0; qq < 4; ++qq) {
        const int tok = 2 * t + (qq & 1) + (qq >> 1) * 8;
        for (int i = 0; i < Map::VW; ++i) {
          vw[qq][i] = load32(packed.data() + tok * RB + g * Map::BPLV + 4 * i, Map::BPLV >= 4 ? 4 : Map::BPLV);
        }
      }
      b[lane][0] = Map::value_b(vw[0], vw[1], nt);
      b[lane][1] = Map::value_b(vw[2], vw[3], nt);
      a[lane][0] = pack(P[g * 16 + 2 * t], P[g * 16 + 2 * t + 1]);
      a[lane][1] = 0;
      a[lane][2] = pack(P[g * 16 + 2 * t + 8], P[g * 16 + 2 * t + 9]);
      a[lane][3] = 0;
    }
    double O[16][8] = {};
    emulate_mma(a, b, O);
    for (int n = 0; n < 8; ++n) {
      const int ch = Map::value_channel(nt, n);
      vseen.insert(ch);
      for (int r = 0; r < 8; ++r) {
        double want = 0;
        for (int k = 0; k < 16; ++k) want += P[r * 16 + k] * codes[k * D + ch];
        ASSERT_EQ(O[r][n], want) << "values bits " << BITS << " D " << D << " n-tile " << nt << " n " << n;
      }
    }
  }
  for (int c = 0; c < D; ++c) ASSERT_EQ(vseen.count(c), 1u) << "value channel " << c;
}

TEST(FragmentMaps, PackedKeysAndValuesGiveExactDotProducts) {
  check_packed<2, 64>();
  check_packed<4, 64>();
  check_packed<8, 64>();
  check_packed<2, 128>();
  check_packed<4, 128>();
  check_packed<8, 128>();
}

template <int D>
void check_dense() {
  using Map = DenseMap<D>;
  std::mt19937 rng(D);
  std::vector<float> rows(16 * D), q(8 * D), P(8 * 16);
  for (auto& x : rows) x = static_cast<float>(static_cast<int>(rng() % 17) - 8);
  for (auto& x : q) x = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  for (auto& x : P) x = static_cast<float>(rng() % 5);
  std::vector<std::uint16_t> h(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) h[i] = f32_to_fp16(rows[i]);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(h.data());
  // Keys: lane t's chunk 4c + t (16 bytes) -> pairs 4c + wi, the words as they are.
  double C[16][8] = {};
  for (int ks = 0; ks < D / 16; ++ks) {
    std::uint32_t a[32][4], b[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4, c = ks / 2, wi0 = (ks % 2) * 2;
      const std::uint8_t* chunk = bytes + g * D * 2 + (4 * c + t) * 16;
      b[lane][0] = load32(chunk + 4 * wi0);
      b[lane][1] = load32(chunk + 4 * (wi0 + 1));
      const auto qv = [&](int p, int e) { return q[g * D + Map::key_channel(p, e, t)]; };
      a[lane][0] = pack(qv(2 * ks, 0), qv(2 * ks, 1));
      a[lane][1] = 0;
      a[lane][2] = pack(qv(2 * ks + 1, 0), qv(2 * ks + 1, 1));
      a[lane][3] = 0;
    }
    emulate_mma(a, b, C);
  }
  for (int r = 0; r < 8; ++r) {
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int c = 0; c < D; ++c) want += q[r * D + c] * rows[n * D + c];
      ASSERT_EQ(C[r][n], want) << "dense keys D " << D;
    }
  }
  // Values: chunk g + 8c8 of tokens {2t, 2t+1, 2t+8, 2t+9}; pairs by PRMT.
  std::multiset<int> vseen;
  for (int nt = 0; nt < D / 8; ++nt) {
    const int e = nt % 2, wi = (nt / 2) % 4, c8 = nt / 8;
    std::uint32_t a[32][4], b[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      std::uint32_t w[4];
      for (int qq = 0; qq < 4; ++qq) {
        const int tok = 2 * t + (qq & 1) + (qq >> 1) * 8;
        w[qq] = load32(bytes + tok * D * 2 + (g + 8 * c8) * 16 + 4 * wi);
      }
      const std::uint32_t sel = e ? 0x7632u : 0x5410u;
      b[lane][0] = prmt(w[0], w[1], sel);
      b[lane][1] = prmt(w[2], w[3], sel);
      a[lane][0] = pack(P[g * 16 + 2 * t], P[g * 16 + 2 * t + 1]);
      a[lane][1] = 0;
      a[lane][2] = pack(P[g * 16 + 2 * t + 8], P[g * 16 + 2 * t + 9]);
      a[lane][3] = 0;
    }
    double O[16][8] = {};
    emulate_mma(a, b, O);
    for (int n = 0; n < 8; ++n) {
      const int ch = Map::value_channel(nt, n);
      vseen.insert(ch);
      for (int r = 0; r < 8; ++r) {
        double want = 0;
        for (int k = 0; k < 16; ++k) want += P[r * 16 + k] * rows[k * D + ch];
        ASSERT_EQ(O[r][n], want) << "dense values D " << D << " n-tile " << nt;
      }
    }
  }
  for (int c = 0; c < D; ++c) ASSERT_EQ(vseen.count(c), 1u) << "dense value channel " << c;
}

TEST(FragmentMaps, DenseKeysAndValuesGiveExactDotProducts) {
  check_dense<64>();
  check_dense<128>();
}

TEST(FragmentMaps, CodesToHalf2IsExactForEveryCode) {
  for (std::uint32_t c0 = 0; c0 < 256; ++c0) {
    const std::uint32_t c1 = 255 - c0;
    const std::uint32_t r = codes_to_half2(c0 | (c1 << 16));
    ASSERT_EQ(half_of(r, 0), static_cast<float>(c0));
    ASSERT_EQ(half_of(r, 1), static_cast<float>(c1));
  }
}

}  // namespace
}  // namespace kvslim::cuda
