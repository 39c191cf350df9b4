// The CUDA attention kernels feed packed codes and fp16 rows to the tensor cores in the order they
// lie in memory, so each lane's registers hold a permutation of channels (src/kvslim/cuda/
// fragment_maps.h). This emulates one warp's mma.m16n8k16 (dense rows) and mma.m16n8k32 (int8:
// codes) on the host, with the fragment layouts of the PTX ISA, and checks that every map gives
// exactly q . k for every token and P . V for every channel -- on any machine, GPU or not.
#include <gtest/gtest.h>

#include <cmath>
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

std::int8_t byte_of(std::uint32_t reg, int e) { return static_cast<std::int8_t>((reg >> (8 * e)) & 0xffu); }

// C[16][8] += A[16][32] (u8) B[32][8] (s8) from per-lane fragments of mma.m16n8k32 (PTX ISA layout:
// a[0] = (row g, k 4t..4t+3), a[1] = (row g+8, same k), a[2] = (row g, k 16+4t..), a[3] = (row g+8,
// k 16+4t..); b[0] = (k 4t..4t+3, col g), b[1] = (k 16+4t.., col g); byte e = k + e).
void emulate_imma(const std::uint32_t a[32][4], const std::uint32_t b[32][2], std::int64_t C[16][8]) {
  std::int64_t A[16][32] = {}, B[32][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
      A[g][4 * t + e] = (a[lane][0] >> (8 * e)) & 0xffu;
      A[g + 8][4 * t + e] = (a[lane][1] >> (8 * e)) & 0xffu;
      A[g][16 + 4 * t + e] = (a[lane][2] >> (8 * e)) & 0xffu;
      A[g + 8][16 + 4 * t + e] = (a[lane][3] >> (8 * e)) & 0xffu;
      B[4 * t + e][g] = byte_of(b[lane][0], e);
      B[16 + 4 * t + e][g] = byte_of(b[lane][1], e);
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 32; ++k) C[r][n] += A[r][k] * B[k][n];
}

// Lane (g, t)'s A registers of the int8 key product's k-step ks (tokens 16 mt + g and + 8, the
// int8 maps' layout: KW words of a packed row at t RB / 4), each made by key_reg(words, r).
template <typename Map, typename KeyReg>
void key_fragment(const std::vector<std::uint8_t>& packed, int mt, int ks, int lane, KeyReg key_reg, std::uint32_t a[4]) {
  const int g = lane / 4, t = lane % 4;
  std::uint32_t w0[Map::KW], w1[Map::KW];
  for (int i = 0; i < Map::KW; ++i) {
    w0[i] = load32(packed.data() + (16 * mt + g) * Map::RB + t * (Map::RB / 4) + 4 * i);
    w1[i] = load32(packed.data() + (16 * mt + g + 8) * Map::RB + t * (Map::RB / 4) + 4 * i);
  }
  a[0] = key_reg(w0, 2 * ks);
  a[1] = key_reg(w1, 2 * ks);
  a[2] = key_reg(w0, 2 * ks + 1);
  a[3] = key_reg(w1, 2 * ks + 1);
}

std::uint32_t pack_s8(const int v[4]) {
  std::uint32_t r = 0;
  for (int e = 0; e < 4; ++e) r |= (static_cast<std::uint32_t>(v[e]) & 0xffu) << (8 * e);
  return r;
}

// The kernel's view of one group of 32 tokens: keys as A (tokens 16 mt + g and + 8, every k-step),
// the 8 columns an s8 operand per query column; values transposed into A (channels), P as B.
template <int BITS, int D>
void check_codes() {
  using Map = CodeMap<BITS, D>;
  constexpr int RB = Map::RB;
  std::mt19937 rng(BITS * 1000 + D);
  std::vector<std::uint8_t> codes(32 * D), packed(32 * RB);
  for (auto& c : codes) c = static_cast<std::uint8_t>(rng() % (1u << BITS));
  quant::scalar_kernels().pack_rows(codes.data(), 32, D, BITS, packed.data());
  std::vector<int> q(8 * D), P(8 * 32);  // s8 columns
  for (auto& x : q) x = static_cast<int>(rng() % 256) - 128;
  for (auto& x : P) x = static_cast<int>(rng() % 256) - 128;
  const auto word = [&](int tok, int byte, int bytes = 4) { return load32(packed.data() + tok * RB + byte, bytes); };

  // Keys: C[token][column] over the k-steps, both m-tiles.
  for (int mt = 0; mt < 2; ++mt) {
    std::int64_t C[16][8] = {};
    for (int ks = 0; ks < Map::KS; ++ks) {
      std::uint32_t a[32][4], b[32][2];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        key_fragment<Map>(packed, mt, ks, lane, Map::key_reg, a[lane]);
        for (int slot = 0; slot < 2; ++slot) {
          int v[4];
          for (int e = 0; e < 4; ++e) v[e] = q[g * D + Map::key_channel(2 * ks + slot, e, t)];
          b[lane][slot] = pack_s8(v);
        }
      }
      emulate_imma(a, b, C);
    }
    for (int r = 0; r < 16; ++r) {
      for (int n = 0; n < 8; ++n) {
        std::int64_t want = 0;
        for (int c = 0; c < D; ++c) want += static_cast<std::int64_t>(q[n * D + c]) * codes[(16 * mt + r) * D + c];
        ASSERT_EQ(C[r][n], want) << "keys bits " << BITS << " D " << D << " token " << 16 * mt + r << " column " << n;
      }
    }
  }
  std::multiset<int> seen;
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < Map::NR; ++r)
      for (int e = 0; e < 4; ++e) seen.insert(Map::key_channel(r, e, t));
  for (int c = 0; c < D; ++c) ASSERT_EQ(seen.count(c), 1u) << "key channel " << c;

  // Values: O[channel][column] = sum_tok code[tok][channel] P[column][tok], m-tile by m-tile.
  std::multiset<int> vseen;
  for (int mt = 0; mt < D / 16; ++mt) {
    std::uint32_t a[32][4], b[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      std::uint32_t x[2][16] = {};
      for (int quad = 0; quad < 2; ++quad) {
        const int tok0 = 16 * quad + 4 * t;
        for (int wi = 0; wi < Map::NWV; ++wi) {
          const int bytes = Map::BPLV >= 4 ? 4 : Map::BPLV;
          std::uint32_t w[4];
          for (int i = 0; i < 4; ++i) w[i] = word(tok0 + i, g * Map::BPLV + 4 * wi, bytes);
          gather_quad(w[0], w[1], w[2], w[3], bytes, x[quad] + 4 * wi);
        }
      }
      a[lane][0] = Map::value_reg(x[0], 2 * mt);
      a[lane][1] = Map::value_reg(x[0], 2 * mt + 1);
      a[lane][2] = Map::value_reg(x[1], 2 * mt);
      a[lane][3] = Map::value_reg(x[1], 2 * mt + 1);
      for (int slot = 0; slot < 2; ++slot) {
        int v[4];
        for (int e = 0; e < 4; ++e) v[e] = P[g * 32 + 16 * slot + 4 * t + e];
        b[lane][slot] = pack_s8(v);
      }
    }
    std::int64_t O[16][8] = {};
    emulate_imma(a, b, O);
    for (int g = 0; g < 8; ++g) {
      for (int rh = 0; rh < 2; ++rh) {
        const int ch = Map::value_channel(2 * mt + rh, g);
        vseen.insert(ch);
        for (int n = 0; n < 8; ++n) {
          std::int64_t want = 0;
          for (int k = 0; k < 32; ++k) want += static_cast<std::int64_t>(P[n * 32 + k]) * codes[k * D + ch];
          ASSERT_EQ(O[g + 8 * rh][n], want) << "values bits " << BITS << " D " << D << " m-tile " << mt << " row " << g + 8 * rh;
        }
      }
    }
  }
  for (int c = 0; c < D; ++c) ASSERT_EQ(vseen.count(c), 1u) << "value channel " << c;
}

TEST(FragmentMaps, CodesThroughTheInt8ProductGiveExactDotProducts) {
  check_codes<2, 64>();
  check_codes<4, 64>();
  check_codes<8, 64>();
  check_codes<2, 128>();
  check_codes<4, 128>();
  check_codes<8, 128>();
}

// The decode codes kernel's keys (attend_codes_half.cu, InPlaceKeyMap): codes masked in place (code * 2^(BITS *
// plane)), q' / max|q'| as four s8 digits scaled per plane, digits 3, 2 in one mma's columns 2v,
// 2v + 1 and digits 1, 0 in a second's. The combined sums must equal sum_c code_c 2^(BITS plane)
// round(q'_c 2^scale_bits) exactly, stay within 2^22 per column, and be q . code * 2^kTotalBits to
// the worst plane's rounding.
template <int BITS, int D>
void check_in_place_keys() {
  using IK = InPlaceKeyMap<BITS, D>;
  using Map = typename IK::Map;
  constexpr int RB = Map::RB;
  std::mt19937 rng(BITS * 100 + D + 3);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<std::uint8_t> codes(32 * D), packed(32 * RB);
    // Trial 2: every code at its largest and q' at +-1: the column sums' bound.
    for (auto& c : codes) c = static_cast<std::uint8_t>(trial == 2 ? (1u << BITS) - 1 : rng() % (1u << BITS));
    quant::scalar_kernels().pack_rows(codes.data(), 32, D, BITS, packed.data());
    std::vector<float> q(4 * D);  // 4 vectors of q' / max|q'|
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    for (auto& x : q) x = trial == 2 ? (rng() % 2 ? 1.f : -1.f) : uni(rng) * (trial == 1 ? 1e-3f : 1.f);
    // The integer each channel's q' became, as the kernel's digits hold it.
    const auto integer_of = [&](int v, int c, int r) {
      return static_cast<std::int64_t>(std::nearbyint(static_cast<double>(q[v * D + c]) * std::ldexp(1.0, IK::scale_bits(r))));
    };
    for (int mt = 0; mt < 2; ++mt) {
      std::int64_t C1[16][8] = {}, C2[16][8] = {};
      for (int ks = 0; ks < Map::KS; ++ks) {
        std::uint32_t a[32][4], b1[32][2], b2[32][2];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4, v = g / 2;
          key_fragment<Map>(packed, mt, ks, lane, IK::key_reg, a[lane]);
          for (int slot = 0; slot < 2; ++slot) {
            const int r = 2 * ks + slot;
            float x[4];
            for (int e = 0; e < 4; ++e) x[e] = q[v * D + Map::key_channel(r, e, t)];
            std::uint32_t d[4];
            IK::q_digits(x, r, d);
            b1[lane][slot] = g % 2 ? d[2] : d[3];
            b2[lane][slot] = g % 2 ? d[0] : d[1];
          }
        }
        emulate_imma(a, b1, C1);
        emulate_imma(a, b2, C2);
      }
      for (int r = 0; r < 16; ++r) {
        for (int v = 0; v < 4; ++v) {
          for (int col = 2 * v; col < 2 * v + 2; ++col) {
            ASSERT_LT(std::llabs(C1[r][col]), 1LL << 22) << "bits " << BITS << " D " << D;
            ASSERT_LT(std::llabs(C2[r][col]), 1LL << 22) << "bits " << BITS << " D " << D;
          }
          const std::int64_t got = C1[r][2 * v] * (1LL << 24) + C1[r][2 * v + 1] * (1LL << 16) + C2[r][2 * v] * 256 + C2[r][2 * v + 1];
          std::int64_t want = 0;
          double exact = 0, bound = 0;
          const int tok = 16 * mt + r;
          for (int t = 0; t < 4; ++t) {
            for (int reg = 0; reg < Map::NR; ++reg) {
              for (int e = 0; e < 4; ++e) {
                const int c = Map::key_channel(reg, e, t);
                want += static_cast<std::int64_t>(codes[tok * D + c]) * (1LL << (BITS * IK::plane(reg))) * integer_of(v, c, reg);
                exact += static_cast<double>(codes[tok * D + c]) * q[v * D + c];
                bound += static_cast<double>(codes[tok * D + c]);
              }
            }
          }
          ASSERT_EQ(got, want) << "bits " << BITS << " D " << D << " trial " << trial << " token " << tok << " vector " << v;
          // Each product is off by at most half a unit of the worst plane's 2^-kFixedBits.
          EXPECT_LE(std::fabs(std::ldexp(static_cast<double>(got), -IK::kTotalBits) - exact),
                    bound * std::ldexp(0.5, -IK::kFixedBits) + 1e-12)
              << "bits " << BITS << " D " << D << " token " << tok << " vector " << v;
        }
      }
    }
  }
}

TEST(FragmentMaps, CodesInPlaceThroughTheInt8ProductWithPlaneScaledDigits) {
  check_in_place_keys<2, 64>();
  check_in_place_keys<4, 64>();
  check_in_place_keys<8, 64>();
  check_in_place_keys<2, 128>();
  check_in_place_keys<4, 128>();
  check_in_place_keys<8, 128>();
}

// The value product of one unit in attend_codes_half.cu (HalfCodeMap, HalfUnitOrder): the softmax
// lanes' digits of P' (biased_p_digits, pack_p_digits) written at p_word and read back as B, lane
// (g, t)'s codes of k-blocks t and t + 4 gathered by byte (gather_quad) and masked in place
// (value_reg) as A. Every row's 256 hi + lo must be sum_tok round(P' R) code * 2^value_shift exactly,
// each sum within the s32 accumulator's range, and every channel reached once.
template <int BITS, int D>
void check_half_values() {
  using Map = HalfCodeMap<BITS, D>;
  using Order = HalfUnitOrder;
  constexpr int RB = Map::RB, BPLV = Map::BPLV;
  std::mt19937 rng(BITS * 1000 + D + 7);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<std::uint8_t> codes(32 * D), packed(32 * RB);
  for (auto& c : codes) c = static_cast<std::uint8_t>(rng() % (1u << BITS));
  for (int c = 0; c < D; ++c) codes[(c % 32) * D + c] = static_cast<std::uint8_t>((1u << BITS) - 1);  // the largest code
  quant::scalar_kernels().pack_rows(codes.data(), 32, D, BITS, packed.data());
  std::vector<float> P(4 * 32);  // P' [vector][token]: one 1 (the unit's largest) a vector, zeros, ties
  for (auto& x : P) x = unit(rng);
  for (int v = 0; v < 4; ++v) {
    P[v * 32 + 5 * v] = 1.f;
    P[v * 32 + 31 - v] = 0.f;
    P[v * 32 + 20] = 0.5f / Map::kDigitRange;  // a tie: rounds to even
  }
  std::vector<long> want_v(4 * 32);
  for (int i = 0; i < 4 * 32; ++i) want_v[i] = std::lrint(static_cast<double>(P[i]) * Map::kDigitRange);
  // The softmax lanes: (g, t) holds tokens g + 8 j of vector t.
  std::vector<std::uint32_t> pw(64, 0xdeadbeefu);
  std::multiset<int> words;
  for (int g = 0; g < 8; ++g) {
    for (int t = 0; t < 4; ++t) {
      std::uint32_t u[4];
      for (int j = 0; j < 4; ++j) u[j] = Map::biased_p_digits(P[t * 32 + g + 8 * j]);
      std::uint32_t hi, lo;
      Map::pack_p_digits(u[0], u[1], u[2], u[3], hi, lo);
      for (int j = 0; j < 4; ++j) {
        const int dh = static_cast<std::int8_t>(hi >> (8 * j)), dl = static_cast<std::int8_t>(lo >> (8 * j));
        ASSERT_GE(dh, 0) << "hi digit";
        ASSERT_EQ(256L * dh + dl, want_v[t * 32 + g + 8 * j]) << "P' " << P[t * 32 + g + 8 * j];
      }
      pw[Map::p_word(2 * t, g)] = hi;
      pw[Map::p_word(2 * t + 1, g)] = lo;
      words.insert(Map::p_word(2 * t, g));
      words.insert(Map::p_word(2 * t + 1, g));
    }
  }
  for (int i = 0; i < 64; ++i) ASSERT_EQ(words.count(i), 1u) << "P word " << i;
  std::uint32_t b[32][2];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    ASSERT_EQ(Map::p_word(g, t + 4), Map::p_word(g, t) + 1) << "one 8-byte read";
    b[lane][0] = pw[Map::p_word(g, t)];
    b[lane][1] = pw[Map::p_word(g, t + 4)];
  }
  std::multiset<int> tokens;
  for (int kb = 0; kb < 8; ++kb) {
    for (int j = 0; j < 4; ++j) tokens.insert(Order::value_token(kb, j));
  }
  for (int k = 0; k < 32; ++k) ASSERT_EQ(tokens.count(k), 1u) << "token " << k;

  std::multiset<int> vseen;
  for (int mt = 0; mt < Map::MT; ++mt) {
    std::uint32_t a[32][4];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      std::uint32_t x[2][BPLV];
      for (int h = 0; h < 2; ++h) {
        for (int n = 0; n < Map::NWV; ++n) {
          const int bytes = BPLV >= 4 ? 4 : BPLV;
          std::uint32_t w[4];
          for (int j = 0; j < 4; ++j) w[j] = load32(packed.data() + Order::value_token(t + 4 * h, j) * RB + g * BPLV + 4 * n, bytes);
          gather_quad(w[0], w[1], w[2], w[3], bytes, x[h] + 4 * n);
        }
      }
      a[lane][0] = Map::value_reg(x[0], 2 * mt);
      a[lane][1] = Map::value_reg(x[0], 2 * mt + 1);
      a[lane][2] = Map::value_reg(x[1], 2 * mt);
      a[lane][3] = Map::value_reg(x[1], 2 * mt + 1);
    }
    std::int64_t C[16][8] = {};
    emulate_imma(a, b, C);
    for (int g = 0; g < 8; ++g) {
      for (int rh = 0; rh < 2; ++rh) {
        const int i = 2 * mt + rh, ch = Map::value_channel(i, g);
        vseen.insert(ch);
        for (int t = 0; t < 4; ++t) {
          std::int64_t want = 0;
          for (int tok = 0; tok < 32; ++tok) want += want_v[t * 32 + tok] * (std::int64_t{codes[tok * D + ch]} << Map::value_shift(i));
          const std::int64_t hi = C[g + 8 * rh][2 * t], lo = C[g + 8 * rh][2 * t + 1];
          ASSERT_EQ(256 * hi + lo, want) << "values bits " << BITS << " D " << D << " m-tile " << mt << " row " << g + 8 * rh;
          ASSERT_LT(std::llabs(256 * hi + lo), std::int64_t{1} << 31) << "the joined sum fits the kernel's int";
        }
      }
    }
  }
  for (int c = 0; c < D; ++c) ASSERT_EQ(vseen.count(c), 1u) << "value channel " << c;
}

TEST(FragmentMaps, ValueCodesInPlaceThroughTheInt8ProductWithPDigits) {
  check_half_values<2, 64>();
  check_half_values<4, 64>();
  check_half_values<8, 64>();
  check_half_values<2, 128>();
  check_half_values<4, 128>();
  check_half_values<8, 128>();
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

// The balanced digits reconstruct round(x * inv) exactly over the whole range, ties included.
TEST(FragmentMaps, BalancedDigitsReconstructTheRoundedOperand) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  const float inv3 = 4194304.f;
  std::vector<float> xs{1.f, -1.f, 0.f, 0.5f / inv3, -0.5f / inv3, 32767.5f / inv3, 32640.f / inv3, 128.5f / inv3};
  for (int i = 0; i < 200000; ++i) xs.push_back(unit(rng));
  for (int v = -300; v <= 300; ++v) xs.push_back(static_cast<float>(v * 255 + 127) / inv3);
  for (std::size_t i = 0; i + 4 <= xs.size(); i += 4) {
    std::uint32_t u[4], d[3];
    for (int e = 0; e < 4; ++e) u[e] = biased_digits3(xs[i + e], inv3);
    pack_digits3(u[0], u[1], u[2], u[3], d[0], d[1], d[2]);
    for (int e = 0; e < 4; ++e) {
      const long want = std::lrint(static_cast<double>(xs[i + e]) * inv3);
      const int lo = byte_of(d[0], e), mid = byte_of(d[1], e), hi = byte_of(d[2], e);
      ASSERT_EQ(65536L * hi + 256L * mid + lo, want) << "x = " << xs[i + e];
      ASSERT_LE(std::abs(hi), 64) << "x = " << xs[i + e];
    }
  }
}

TEST(FragmentMaps, GatherQuadTransposesFourTokensBytes) {
  const std::uint32_t w[4] = {0x03020100u, 0x13121110u, 0x23222120u, 0x33323130u};  // token i, byte b = 16 i + b
  std::uint32_t x[4];
  gather_quad(w[0], w[1], w[2], w[3], 4, x);
  for (int b = 0; b < 4; ++b) {
    for (int i = 0; i < 4; ++i) ASSERT_EQ((x[b] >> (8 * i)) & 0xffu, 16u * i + b) << "byte " << b << " token " << i;
  }
}

}  // namespace
}  // namespace kvslim::cuda
