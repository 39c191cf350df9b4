// Attention over packed codes by integer dot products (AVX-512 VNNI, vpdpbusd: 64 u8 x s8 products
// per instruction, four times the fp32 FMA's work per instruction), on CPUs that also have VBMI
// (byte permutes; Ice Lake, Zen 4 and later). The fp32 operand -- the query times a group's
// per-channel key scale, or a row of probabilities -- is rounded to 15-bit integers v and split
// into two int8 vectors, v = 256 * hi + lo, x ~ s1 * hi + s2 * lo (s1 = 256 * s2), so a product
// carries a relative error of about 2^-15 (far below the fp16 rounding of the stored rows) while
// the codes never leave their packed bytes. Every group of a block is done in one call; a group's fp16 parameters are widened
// in registers.
//
// A packed row of m = D * bits / 8 bytes holds element e at byte e % m, bits (e / m) * bits: "sub-
// chunk" k of the row (elements [k*m, (k+1)*m)) is the row's bytes shifted right by k * bits and
// masked.
// GCC 12 warns inside its own AVX-512 headers (the _mm512_undefined_* they use for the
// cast/extract intrinsics); the warnings say nothing about this file.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attend/attend_kernels.h"
#include "kvslim/convert.h"

#define KVSLIM_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")))

namespace kvslim::attend {
namespace {

// KVSLIM_NO_INT8_ATTEND=1 turns the integer path off (measurements against the fp32 kernels).
std::atomic<bool> g_int8_enabled{std::getenv("KVSLIM_NO_INT8_ATTEND") == nullptr};

bool cpu_has_int8() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
}

constexpr int kQueries = 4;  // query vectors per pass (GQA groups of 1-4 heads; larger ones loop)
constexpr std::size_t kMaxDim = 256;

// Per 128-bit block, [f(a0), f(a1), f(a2), f(a3)] where f folds a vector's 16 lanes by max or add
// (the same four values in every block).
template <bool kMax>
KVSLIM_INT8_TARGET inline __m512 op(__m512 a, __m512 b) {
  if constexpr (kMax) {
    return _mm512_max_ps(a, b);
  } else {
    return _mm512_add_ps(a, b);
  }
}
template <bool kMax>
KVSLIM_INT8_TARGET inline __m512 fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = op<kMax>(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = op<kMax>(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 t = op<kMax>(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  t = op<kMax>(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  return op<kMax>(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
}

// The split of four vectors: s1[i], s2[i] and inv2[i] = 1 / s2[i] (all 0 for a vector that is all
// zero or not finite, whose codes are then 0) and a per-vector figure (the query's bias, or the
// probabilities' sum).
struct Split4 {
  alignas(16) float s1[kQueries], s2[kQueries], inv2[kQueries], extra[kQueries];
};
// [v0, v1, v2, v3] in every 128-bit block.
KVSLIM_INT8_TARGET inline __m512 blocks_of(const float* v4) { return _mm512_broadcast_f32x4(_mm_load_ps(v4)); }

// |v| <= 127 * 256 (+1 by rounding): hi = (v + 128) >> 8 stays within [-127, 127] and lo within
// [-128, 127].
constexpr float kRange = 127.0f * 256.0f;

// From the four vectors' absolute maxima (every block [a0..a3]): their scales, 0 where the maximum
// is not positive and finite.
KVSLIM_INT8_TARGET inline void set_scales(__m512 amax, Split4& sp) {
  const __m128 a = _mm512_castps512_ps128(amax);
  const __mmask8 ok = static_cast<__mmask8>(_mm_cmp_ps_mask(a, _mm_setzero_ps(), _CMP_GT_OQ) &
                                            _mm_cmp_ps_mask(a, _mm_set1_ps(INFINITY), _CMP_LT_OQ));
  const __m128 s2 = _mm_maskz_div_ps(ok, a, _mm_set1_ps(kRange));
  _mm_store_ps(sp.s2, s2);
  _mm_store_ps(sp.s1, _mm_mul_ps(s2, _mm_set1_ps(256.0f)));
  _mm_store_ps(sp.inv2, _mm_maskz_div_ps(ok, _mm_set1_ps(kRange), a));
}

// Where split32's packs leave each byte: source byte of hi[e] (e < 32) and lo[e] (32 + e). packs
// work per 128-bit block: block b holds elements 4b..4b+3 and 16+4b..16+4b+3, hi then lo.
constexpr std::array<std::uint8_t, 64> kUnscramble = [] {
  std::array<std::uint8_t, 64> idx{};
  for (std::size_t e = 0; e < 32; ++e) {
    const std::size_t b = (e % 16) / 4, j = e % 4 + (e < 16 ? 0 : 4);
    idx[e] = static_cast<std::uint8_t>(16 * b + j);
    idx[32 + e] = static_cast<std::uint8_t>(16 * b + 8 + j);
  }
  return idx;
}();

// 32 values (x0: elements 0-15, x1: 16-31) times inv2 rounded to v and split: bytes 0-31 of the
// result are hi[e], bytes 32-63 lo[e], v = 256 * hi + lo.
KVSLIM_INT8_TARGET inline __m512i split32(__m512 x0, __m512 x1, __m512 inv2) {
  const __m512i v = _mm512_packs_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv2)),
                                       _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv2)));
  const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(v, _mm512_set1_epi16(128)), 8);
  const __m512i l = _mm512_sub_epi16(v, _mm512_slli_epi16(h, 8));
  return _mm512_permutexvar_epi8(_mm512_loadu_si512(kUnscramble.data()), _mm512_packs_epi16(h, l));
}

// Asks for [p, p + bytes) in L1 ahead of use: a block's codes and parameters stream from memory,
// and the hardware prefetcher alone leaves the dot products waiting on them.
inline void prefetch(const void* p, std::size_t bytes) {
  const auto* c = static_cast<const char*>(p);
  for (std::size_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
// Group gi + kAhead of a set: its codes and fp16 params.
constexpr std::size_t kAhead = 4;
inline void prefetch_group(const std::uint8_t* packed, const std::uint16_t* scale_h, const std::uint16_t* zero_h,
                           std::size_t gi, std::size_t group_size, std::size_t n, std::size_t m, std::size_t D) {
  const std::size_t r0 = (gi + kAhead) * group_size;
  if (r0 >= n) return;
  prefetch(packed + r0 * m, std::min(group_size, n - r0) * m);
  prefetch(scale_h + (gi + kAhead) * D, D * sizeof(std::uint16_t));
  prefetch(zero_h + (gi + kAhead) * D, D * sizeof(std::uint16_t));
}

// ---- keys ----------------------------------------------------------------------------------------
// With m in {16, 32, 64}, R = 64 / m consecutive rows fill one 512-bit register; each sub-chunk of
// the query is replicated into every row slot, and four query vectors (the query heads of one KV
// head, padded) are reduced together by a transposing add tree: per 128-bit block the four
// queries' partial sums, one block per 16 bytes of row.

// Splits queries q[i] * scale (i < nq, D floats each, D a multiple of 16 and <= 256; scale and
// zero fp16 [D]) into the replicated chunk layout qv [2][kQueries][K][64]: element d goes to byte
// (d % m) of row slot r (r < 64 / m) of chunk d / m, hi parts first. Chunks of queries i >= nq are left
// as they are (their results are never stored). extra[i] = q[i] . zero.
// kFour: nq = 4 (the common GQA group; the loops over queries unroll and stay in registers).
template <std::size_t m, bool kFour>
KVSLIM_INT8_TARGET void split_queries(const float* q, int nq_in, std::size_t D, const std::uint16_t* scale_h,
                                      const std::uint16_t* zero_h, std::uint8_t* qv, Split4& sp) {
  const int nq = kFour ? kQueries : nq_in;
  const int K = static_cast<int>(D / m);  // sub-chunks of a row (bits = 8 / K)
  alignas(64) float ys[kQueries][kMaxDim];  // q * scale
  __m512 mx[kQueries], bs[kQueries];
  for (int i = 0; i < kQueries; ++i) mx[i] = bs[i] = _mm512_setzero_ps();
  for (std::size_t d = 0; d < D; d += 16) {
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale_h + d)));
    const __m512 ze = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zero_h + d)));
    for (int i = 0; i < nq; ++i) {
      const __m512 x = _mm512_loadu_ps(q + static_cast<std::size_t>(i) * D + d);
      const __m512 y = _mm512_mul_ps(x, sc);
      _mm512_store_ps(ys[i] + d, y);
      mx[i] = _mm512_max_ps(mx[i], _mm512_abs_ps(y));
      bs[i] = _mm512_fmadd_ps(x, ze, bs[i]);
    }
  }
  set_scales(fold4<true>(mx[0], mx[1], mx[2], mx[3]), sp);
  _mm_store_ps(sp.extra, _mm512_castps512_ps128(fold4<false>(bs[0], bs[1], bs[2], bs[3])));
  for (int i = 0; i < nq; ++i) {
    std::uint8_t* hi = qv + static_cast<std::size_t>(i) * static_cast<std::size_t>(K) * 64;
    std::uint8_t* lo = hi + static_cast<std::size_t>(kQueries) * static_cast<std::size_t>(K) * 64;
    if (sp.s1[i] == 0.0f) {  // zero (or broken) query: every product 0
      for (int k = 0; k < K; ++k) {
        _mm512_store_si512(hi + k * 64, _mm512_setzero_si512());
        _mm512_store_si512(lo + k * 64, _mm512_setzero_si512());
      }
      continue;
    }
    const __m512 inv2 = _mm512_set1_ps(sp.inv2[i]);
    for (std::size_t d = 0; d < D; d += 32) {
      const bool pair = d + 16 < D;  // D = 16 has one chunk of 16
      const __m512i c = split32(_mm512_load_ps(ys[i] + d), pair ? _mm512_load_ps(ys[i] + d + 16) : _mm512_setzero_ps(),
                                inv2);
      if constexpr (m == 16) {  // each 16 bytes fill every row slot of their chunk
        _mm512_store_si512(hi + (d / 16) * 64, _mm512_shuffle_i32x4(c, c, 0x00));
        _mm512_store_si512(lo + (d / 16) * 64, _mm512_shuffle_i32x4(c, c, 0xAA));
        if (pair) {
          _mm512_store_si512(hi + (d / 16 + 1) * 64, _mm512_shuffle_i32x4(c, c, 0x55));
          _mm512_store_si512(lo + (d / 16 + 1) * 64, _mm512_shuffle_i32x4(c, c, 0xFF));
        }
      } else if constexpr (m == 32) {  // the 32 bytes fill both row slots of chunk d / 32
        _mm512_store_si512(hi + (d / 32) * 64, _mm512_shuffle_i64x2(c, c, 0x44));
        _mm512_store_si512(lo + (d / 32) * 64, _mm512_shuffle_i64x2(c, c, 0xEE));
      } else {  // half of chunk d / 64's one row slot
        _mm256_store_si256(reinterpret_cast<__m256i*>(hi + (d / 64) * 64 + d % 64), _mm512_castsi512_si256(c));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo + (d / 64) * 64 + d % 64), _mm512_extracti64x4_epi64(c, 1));
      }
    }
  }
}

// [q0, q1, q2, q3] partial sums per 128-bit block of the four accumulators.
KVSLIM_INT8_TARGET inline __m512i reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// Block b of the result holds, for the row slot it ends, the four queries' dot products.
template <int R>
KVSLIM_INT8_TARGET inline __m512i fold_blocks(__m512i t) {
  if constexpr (R <= 2) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (R == 1) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return t;
}

// n rows of one group; R rows per register (m = 64 / R bytes a row), K sub-chunks (bits = 8 / K).
// logits[i * ld + r] for i < nq.
template <int R, int K>
KVSLIM_INT8_TARGET void logits_rows(const std::uint8_t* qv /* [2][kQueries][K][64] */, const Split4& sp, int nq,
                                    const std::uint8_t* packed, std::size_t n, float* logits, std::size_t ld) {
  constexpr std::size_t m = 64 / R;
  constexpr int bits = 8 / K;
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  // Per 128-bit block: [s_q0, s_q1, s_q2, s_q3] (the scales) and the biases.
  const __m512 vs1 = blocks_of(sp.s1), vs2 = blocks_of(sp.s2), vb = blocks_of(sp.extra);
  const auto* Q = reinterpret_cast<const __m512i*>(qv);  // Q[(h * kQueries + i) * K + k]
  alignas(64) float out[16];
  // Lane j of the transposed result: query j / R of row slot j % R, whose value sits in lane
  // 4 * (block ending slot r) + query (R = 4: blocks 0-3; R = 2: blocks 1 and 3).
  static constexpr auto kByQuery = [] {
    std::array<std::int32_t, 16> lanes{};
    for (int j = 0; j < 16 && R > 1; ++j) {
      const int query = j / R, slot = j % R;
      lanes[static_cast<std::size_t>(j)] = query < 4 ? (slot * (4 / R) + (4 / R - 1)) * 4 + query : 0;
    }
    return lanes;
  }();
  const __m512i by_query = _mm512_loadu_si512(kByQuery.data());
  for (std::size_t r0 = 0; r0 < n; r0 += R) {
    const std::size_t here = std::min<std::size_t>(R, n - r0);
    const __m512i v = here == static_cast<std::size_t>(R)
                          ? _mm512_loadu_si512(packed + r0 * m)
                          : _mm512_maskz_loadu_epi8(here * m >= 64 ? ~0ULL : (1ULL << (here * m)) - 1, packed + r0 * m);
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
    for (int k = 0; k < K; ++k) {
      const __m512i c = k == 0 ? _mm512_and_si512(v, mask) : _mm512_and_si512(_mm512_srli_epi16(v, k * bits), mask);
      h0 = _mm512_dpbusd_epi32(h0, c, _mm512_load_si512(Q + (0 * kQueries + 0) * K + k));
      h1 = _mm512_dpbusd_epi32(h1, c, _mm512_load_si512(Q + (0 * kQueries + 1) * K + k));
      h2 = _mm512_dpbusd_epi32(h2, c, _mm512_load_si512(Q + (0 * kQueries + 2) * K + k));
      h3 = _mm512_dpbusd_epi32(h3, c, _mm512_load_si512(Q + (0 * kQueries + 3) * K + k));
      l0 = _mm512_dpbusd_epi32(l0, c, _mm512_load_si512(Q + (1 * kQueries + 0) * K + k));
      l1 = _mm512_dpbusd_epi32(l1, c, _mm512_load_si512(Q + (1 * kQueries + 1) * K + k));
      l2 = _mm512_dpbusd_epi32(l2, c, _mm512_load_si512(Q + (1 * kQueries + 2) * K + k));
      l3 = _mm512_dpbusd_epi32(l3, c, _mm512_load_si512(Q + (1 * kQueries + 3) * K + k));
    }
    const __m512i th = fold_blocks<R>(reduce4(h0, h1, h2, h3));
    const __m512i tl = fold_blocks<R>(reduce4(l0, l1, l2, l3));
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(th), vs1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(tl), vs2, vb));
    if (R == 4 && here == 4) {
      // Transposed to [query][row slot]: each query's four logits in one 128-bit store.
      const __m512 t = _mm512_permutexvar_ps(by_query, f);
      _mm_storeu_ps(logits + r0, _mm512_castps512_ps128(t));
      if (nq > 1) _mm_storeu_ps(logits + ld + r0, _mm512_extractf32x4_ps(t, 1));
      if (nq > 2) _mm_storeu_ps(logits + 2 * ld + r0, _mm512_extractf32x4_ps(t, 2));
      if (nq > 3) _mm_storeu_ps(logits + 3 * ld + r0, _mm512_extractf32x4_ps(t, 3));
      continue;
    }
    if (R == 2 && here == 2) {  // each query's two logits: one 64-bit store
      const __m512 t = _mm512_permutexvar_ps(by_query, f);
      const __m128 b0 = _mm512_castps512_ps128(t), b1 = _mm512_extractf32x4_ps(t, 1);
      _mm_storel_pi(reinterpret_cast<__m64*>(logits + r0), b0);
      if (nq > 1) _mm_storeh_pi(reinterpret_cast<__m64*>(logits + ld + r0), b0);
      if (nq > 2) _mm_storel_pi(reinterpret_cast<__m64*>(logits + 2 * ld + r0), b1);
      if (nq > 3) _mm_storeh_pi(reinterpret_cast<__m64*>(logits + 3 * ld + r0), b1);
      continue;
    }
    _mm512_store_ps(out, f);
    for (std::size_t r = 0; r < here; ++r) {
      const float* o = out + (r * (4 / R) + (4 / R - 1)) * 4;  // the block that ends row slot r
      for (int i = 0; i < nq; ++i) logits[static_cast<std::size_t>(i) * ld + r0 + r] = o[i];
    }
  }
}

// ---- values --------------------------------------------------------------------------------------
// acc[m, c] += sum_r p[m, r] * (code[r, c] * scale[c] + zero[c]) per group by vpdpbusd. A lane of
// vpdpbusd sums four byte products, so four rows' codes of one channel must sit side by side (a
// "set": byte i of rows r..r+3 -> one 32-bit lane). With m = 16 or 32 bytes a row the four rows
// are interleaved in registers by one byte permute; at m = 64 they are interleaved once per group
// into a small buffer. Sub-chunk k of every lane is then a shift and a mask away, as for the keys.
// The probabilities are split like the queries and broadcast four rows at a time.

// How a set of four rows reaches the register: kInterleaved reads a buffer [sets][m / 16][64]
// (interleave_rows); kPermute16 / kPermute32 permute the packed rows (m = 16 / 32) in registers.
enum class SetLayout { kInterleaved, kPermute16, kPermute32 };

// inter [sets][m / 16][64]: for each 16-byte column of the rows, 16 lanes of (row0, row1, row2, row3).
KVSLIM_INT8_TARGET void interleave_rows(const std::uint8_t* packed, std::size_t n, std::size_t m,
                                        std::uint8_t* inter) {
  const std::size_t sets = (n + 3) / 4;
  for (std::size_t s = 0; s < sets; ++s) {
    for (std::size_t col = 0; col < m; col += 16) {
      __m128i row[4];
      for (std::size_t j = 0; j < 4; ++j) {
        const std::size_t r = s * 4 + j;
        row[j] = r < n ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + r * m + col)) : _mm_setzero_si128();
      }
      const __m128i ab_lo = _mm_unpacklo_epi8(row[0], row[1]), ab_hi = _mm_unpackhi_epi8(row[0], row[1]);
      const __m128i cd_lo = _mm_unpacklo_epi8(row[2], row[3]), cd_hi = _mm_unpackhi_epi8(row[2], row[3]);
      auto* out = reinterpret_cast<__m128i*>(inter + (s * (m / 16) + col / 16) * 64);
      _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(ab_lo, cd_lo));  // bytes col+0..3
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(ab_lo, cd_lo));  // col+4..7
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(ab_hi, cd_hi));  // col+8..11
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(ab_hi, cd_hi));  // col+12..15
    }
  }
}

// Byte permutes that interleave a set: destination byte 4L + j (lane L, row j) <- row j's byte
// col + L, row j at source byte j * m (m = 32: rows 2 and 3 in the second source, index + 64).
constexpr std::array<std::uint8_t, 64> interleave_index(std::size_t m, std::size_t col) {
  std::array<std::uint8_t, 64> idx{};
  for (std::size_t L = 0; L < 16; ++L) {
    for (std::size_t j = 0; j < 4; ++j) idx[4 * L + j] = static_cast<std::uint8_t>(j * m + col + L);
  }
  return idx;
}
constexpr auto kPerm16 = interleave_index(16, 0);
constexpr auto kPerm32Col0 = interleave_index(32, 0);
constexpr auto kPerm32Col16 = interleave_index(32, 16);

// The first b <= 64 bytes at p, zeros after.
KVSLIM_INT8_TARGET inline __m512i load_bytes(const std::uint8_t* p, std::size_t b) {
  if (b >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8(b == 0 ? 0 : (~0ULL >> (64 - b)), p);
}

// Bytes a row under each layout.
template <SetLayout kLayout>
constexpr std::size_t kRowBytes = kLayout == SetLayout::kPermute16 ? 16 : kLayout == SetLayout::kPermute32 ? 32 : 64;

// Set t of the group (its first `rows` rows present, 1..4; all four when kFull) as interleaved
// lanes for the 16-byte column `col`.
template <SetLayout kLayout, bool kFull>
KVSLIM_INT8_TARGET inline __m512i load_set(const std::uint8_t* src, std::size_t t, std::size_t rows, std::size_t col,
                                           __m512i perm) {
  constexpr std::size_t m = kRowBytes<kLayout>;
  if constexpr (kLayout == SetLayout::kInterleaved) {  // the buffer is zero past the group's rows
    return _mm512_loadu_si512(src + (t * (m / 16) + col / 16) * 64);
  } else {
    const std::uint8_t* at = src + 4 * t * m;
    const std::size_t bytes = kFull ? 4 * m : rows * m;
    if constexpr (kLayout == SetLayout::kPermute16) {
      return _mm512_permutexvar_epi8(perm, kFull ? _mm512_loadu_si512(at) : load_bytes(at, bytes));
    } else {
      const __m512i a = kFull ? _mm512_loadu_si512(at) : load_bytes(at, std::min<std::size_t>(bytes, 64));
      const __m512i b = kFull ? _mm512_loadu_si512(at + 64) : load_bytes(at + 64, bytes > 64 ? bytes - 64 : 0);
      return _mm512_permutex2var_epi8(a, perm, b);
    }
  }
}

// A pass covers kCols 16-byte columns of the rows with every sub-chunk of each (kCols * K
// "combos" of 16 channels: at most four) for a pair of queries, hi and lo: 16 accumulators at
// most, so that a set is loaded and permuted once per pass.
template <int K, SetLayout kLayout>
constexpr std::size_t kCols = std::min<std::size_t>(4 / K, kRowBytes<kLayout> / 16);
template <int K, SetLayout kLayout>
constexpr std::size_t kCombos = K * kCols<K, kLayout>;

template <int K, SetLayout kLayout, bool kFull>
KVSLIM_INT8_TARGET __attribute__((always_inline)) inline void accumulate_set(
    const std::uint8_t* src, std::size_t t, std::size_t rows, std::size_t col0, const __m512i* perm,
    const std::int32_t* const* words /* [query of pair][hi, lo] */, __m512i (&acc)[kCombos<K, kLayout>][2][2]) {
  constexpr int bits = 8 / K;
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  __m512i w[2][2];
  for (int q = 0; q < 2; ++q) {
    for (int h = 0; h < 2; ++h) w[q][h] = _mm512_set1_epi32(words[q * 2 + h][t]);
  }
#pragma GCC unroll 4
  for (std::size_t c = 0; c < kCols<K, kLayout>; ++c) {
    const __m512i v = load_set<kLayout, kFull>(src, t, rows, col0 + 16 * c, perm[c]);
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) {
      const __m512i code = k == 0 ? _mm512_and_si512(v, mask) : _mm512_and_si512(_mm512_srli_epi16(v, k * bits), mask);
      __m512i(&a)[2][2] = acc[c * K + static_cast<std::size_t>(k)];
      a[0][0] = _mm512_dpbusd_epi32(a[0][0], code, w[0][0]);
      a[0][1] = _mm512_dpbusd_epi32(a[0][1], code, w[0][1]);
      a[1][0] = _mm512_dpbusd_epi32(a[1][0], code, w[1][0]);
      a[1][1] = _mm512_dpbusd_epi32(a[1][1], code, w[1][1]);
    }
  }
}

// One group of n rows (src as kLayout reads it), the split probabilities pk [2][kQueries][sets]
// (int8 x 4 per word) with sp, fp16 params [D] of the group:
// acc[i * D + c] += scale[c] * (s1 * hi . codes + s2 * lo . codes) + zero[c] * psum[i].
template <int K, SetLayout kLayout>
KVSLIM_INT8_TARGET void accumulate_sets(const std::uint8_t* src, std::size_t n, const std::int32_t* pk,
                                        const Split4& sp, int nq, std::size_t D, const std::uint16_t* scale_h,
                                        const std::uint16_t* zero_h, float* acc) {
  constexpr std::size_t m = kRowBytes<kLayout>, cols = kCols<K, kLayout>, combos = kCombos<K, kLayout>;
  const std::size_t sets = (n + 3) / 4, full = n / 4;
  for (std::size_t col0 = 0; col0 < m; col0 += 16 * cols) {
    __m512i perm[cols];
    for (std::size_t c = 0; c < cols; ++c) {
      perm[c] = _mm512_setzero_si512();
      if constexpr (kLayout == SetLayout::kPermute16) perm[c] = _mm512_loadu_si512(kPerm16.data());
      if constexpr (kLayout == SetLayout::kPermute32) {
        perm[c] = _mm512_loadu_si512(col0 + 16 * c == 0 ? kPerm32Col0.data() : kPerm32Col16.data());
      }
    }
    for (int qp = 0; qp < nq; qp += 2) {  // query pairs (a padding query's words are zero)
      const std::int32_t* words[4] = {pk + static_cast<std::size_t>(qp) * sets,
                                      pk + (kQueries + static_cast<std::size_t>(qp)) * sets,
                                      pk + (static_cast<std::size_t>(qp) + 1) * sets,
                                      pk + (kQueries + static_cast<std::size_t>(qp) + 1) * sets};
      __m512i a[combos][2][2];
      for (std::size_t c = 0; c < combos; ++c) a[c][0][0] = a[c][0][1] = a[c][1][0] = a[c][1][1] = _mm512_setzero_si512();
      for (std::size_t t = 0; t < full; ++t) accumulate_set<K, kLayout, true>(src, t, 4, col0, perm, words, a);
      if (full < sets) accumulate_set<K, kLayout, false>(src, full, n - 4 * full, col0, perm, words, a);
      for (std::size_t c = 0; c < combos; ++c) {
        const std::size_t channel = (c % K) * m + col0 + 16 * (c / K);  // lanes: channels channel..+15
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale_h + channel)));
        const __m512 ze = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zero_h + channel)));
        for (int q = 0; q < 2 && qp + q < nq; ++q) {
          const int i = qp + q;
          float* out = acc + static_cast<std::size_t>(i) * D + channel;
          const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[c][q][0]), _mm512_set1_ps(sp.s1[i]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(a[c][q][1]), _mm512_set1_ps(sp.s2[i])));
          _mm512_storeu_ps(out, _mm512_fmadd_ps(sum, sc, _mm512_fmadd_ps(ze, _mm512_set1_ps(sp.extra[i]),
                                                                         _mm512_loadu_ps(out))));
        }
      }
    }
  }
}

// Rows p[i * ld .. + n) (values >= 0) of nq vectors as int8 hi/lo, four rows per int32 (row 4t + j
// in byte j of word t of hi + i * sets, lo + i * sets); every byte of the `sets` words is written
// (zeros past n). extra[i] = the row's sum.
// kFull: nq = 4 and n = 32 (a whole group of the default size: no tails, loops unrolled).
template <bool kFull>
KVSLIM_INT8_TARGET void split_probs(const float* p, std::size_t ld, int nq_in, std::size_t n_in, std::size_t sets_in,
                                    std::int32_t* hi, std::int32_t* lo, Split4& sp) {
  const int nq = kFull ? kQueries : nq_in;
  const std::size_t n = kFull ? 32 : n_in, sets = kFull ? 8 : sets_in;
  const std::size_t bytes = sets * 4;
  auto tail = [](std::size_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1); };
  __m512 mx[kQueries], sm[kQueries];
  for (int i = 0; i < kQueries; ++i) mx[i] = sm[i] = _mm512_setzero_ps();
  for (int i = 0; i < nq; ++i) {
    const float* row = p + static_cast<std::size_t>(i) * ld;
    for (std::size_t r = 0; r < n; r += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(tail(n - r), row + r);
      mx[i] = _mm512_max_ps(mx[i], x);
      sm[i] = _mm512_add_ps(sm[i], x);
    }
  }
  set_scales(fold4<true>(mx[0], mx[1], mx[2], mx[3]), sp);
  _mm_store_ps(sp.extra, _mm512_castps512_ps128(fold4<false>(sm[0], sm[1], sm[2], sm[3])));
  for (int i = 0; i < nq; ++i) {
    const float* row = p + static_cast<std::size_t>(i) * ld;
    auto* h8 = reinterpret_cast<std::int8_t*>(hi + static_cast<std::size_t>(i) * sets);
    auto* l8 = reinterpret_cast<std::int8_t*>(lo + static_cast<std::size_t>(i) * sets);
    if (sp.s1[i] == 0.0f) {
      std::memset(h8, 0, bytes);
      std::memset(l8, 0, bytes);
      continue;
    }
    const __m512 inv2 = _mm512_set1_ps(sp.inv2[i]);
    for (std::size_t r = 0; r < bytes; r += 32) {
      const __m512 x0 = r < n ? _mm512_maskz_loadu_ps(tail(n - r), row + r) : _mm512_setzero_ps();
      const __m512 x1 = r + 16 < n ? _mm512_maskz_loadu_ps(tail(n - r - 16), row + r + 16) : _mm512_setzero_ps();
      const __m512i c = split32(x0, x1, inv2);
      const std::size_t left = bytes - r;
      const auto keep = static_cast<__mmask32>(left >= 32 ? ~0u : (1u << left) - 1);
      _mm256_mask_storeu_epi8(h8 + r, keep, _mm512_castsi512_si256(c));
      _mm256_mask_storeu_epi8(l8 + r, keep, _mm512_extracti64x4_epi64(c, 1));
    }
  }
}

// Sub-chunk geometry of packed rows of D codes at `bits` for the integer kernels: false where they
// do not apply (one bit plane of 2, 4 or 8 bits, m = D * bits / 8 in {16, 32, 64}, D <= 256).
bool int8_geometry(std::size_t D, int bits, std::size_t& m) {
  if (bits != 2 && bits != 4 && bits != 8) return false;
  if (D > kMaxDim || D * static_cast<std::size_t>(bits) % 8 != 0) return false;
  m = D * static_cast<std::size_t>(bits) / 8;
  return m == 16 || m == 32 || m == 64;
}

}  // namespace

bool int8_logits_available() { return cpu_has_int8() && g_int8_enabled.load(std::memory_order_relaxed); }

void set_int8_logits_enabled(bool enabled) { g_int8_enabled.store(enabled, std::memory_order_relaxed); }

}  // namespace kvslim::attend

const char* kvslim::attend_packed_kernels() {
  static const std::string fp32 = std::string("fp32 kernels (") + attend::target_name() + ")";
  return attend::int8_logits_available() ? "int8 dot products (AVX-512 VNNI + VBMI)" : fp32.c_str();
}

namespace kvslim::attend {

bool packed_int8_supported(std::size_t D, int bits) {
  std::size_t m = 0;
  return int8_logits_available() && int8_geometry(D, bits, m);
}

bool logits_packed_int8(const float* q, const std::uint16_t* scale_h, const std::uint16_t* zero_h,
                        std::size_t group_size, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits,
                        std::size_t n, float* logits, std::size_t ld) {
  std::size_t m = 0;
  if (!int8_logits_available() || group_size == 0 || !int8_geometry(D, bits, m)) return false;
  const int K = 8 / bits, R = static_cast<int>(64 / m);
  // [2][kQueries][K][64] replicated query chunks; zeroed once so that padding queries' chunks are
  // defined (their results are never stored).
  alignas(64) std::uint8_t qv[2 * kQueries * 4 * 64] = {};
  Split4 sp;
  for (std::size_t r0 = 0; r0 < n; r0 += group_size) {
    const std::size_t gi = r0 / group_size, cnt = std::min(group_size, n - r0);
    const std::uint8_t* rows = packed + r0 * m;
    prefetch_group(packed, scale_h, zero_h, gi, group_size, n, m, D);
    for (std::size_t m0 = 0; m0 < M; m0 += kQueries) {
      const int nq = static_cast<int>(std::min<std::size_t>(kQueries, M - m0));
      const float* qm = q + m0 * D;
      const std::uint16_t* sc = scale_h + gi * D;
      const std::uint16_t* ze = zero_h + gi * D;
      switch (m * 2 + (nq == kQueries ? 1 : 0)) {
        case 33: split_queries<16, true>(qm, nq, D, sc, ze, qv, sp); break;
        case 32: split_queries<16, false>(qm, nq, D, sc, ze, qv, sp); break;
        case 65: split_queries<32, true>(qm, nq, D, sc, ze, qv, sp); break;
        case 64: split_queries<32, false>(qm, nq, D, sc, ze, qv, sp); break;
        case 129: split_queries<64, true>(qm, nq, D, sc, ze, qv, sp); break;
        default: split_queries<64, false>(qm, nq, D, sc, ze, qv, sp); break;
      }
      float* out = logits + m0 * ld + r0;
      switch (R * 10 + K) {
        case 14: logits_rows<1, 4>(qv, sp, nq, rows, cnt, out, ld); break;  // 2-bit, D = 256
        case 12: logits_rows<1, 2>(qv, sp, nq, rows, cnt, out, ld); break;  // 4-bit, D = 128
        case 11: logits_rows<1, 1>(qv, sp, nq, rows, cnt, out, ld); break;  // 8-bit, D = 64
        case 24: logits_rows<2, 4>(qv, sp, nq, rows, cnt, out, ld); break;  // 2-bit, D = 128
        case 22: logits_rows<2, 2>(qv, sp, nq, rows, cnt, out, ld); break;  // 4-bit, D = 64
        case 21: logits_rows<2, 1>(qv, sp, nq, rows, cnt, out, ld); break;  // 8-bit, D = 32
        case 44: logits_rows<4, 4>(qv, sp, nq, rows, cnt, out, ld); break;  // 2-bit, D = 64
        case 42: logits_rows<4, 2>(qv, sp, nq, rows, cnt, out, ld); break;  // 4-bit, D = 32
        default: logits_rows<4, 1>(qv, sp, nq, rows, cnt, out, ld); break;  // 8-bit, D = 16
      }
    }
  }
  return true;
}

namespace {
template <int K>
KVSLIM_INT8_TARGET void accumulate_group(const std::uint8_t* rows, std::size_t cnt, std::size_t m, std::uint8_t* inter,
                      const std::int32_t* pk, const Split4& sp, int nq, std::size_t D, const std::uint16_t* scale_h,
                      const std::uint16_t* zero_h, float* acc) {
  if (m == 16) {
    accumulate_sets<K, SetLayout::kPermute16>(rows, cnt, pk, sp, nq, D, scale_h, zero_h, acc);
  } else if (m == 32) {
    accumulate_sets<K, SetLayout::kPermute32>(rows, cnt, pk, sp, nq, D, scale_h, zero_h, acc);
  } else {
    accumulate_sets<K, SetLayout::kInterleaved>(inter, cnt, pk, sp, nq, D, scale_h, zero_h, acc);
  }
}
}  // namespace

bool accumulate_packed_int8(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                            std::size_t n, std::size_t D, std::size_t group_size, const std::uint16_t* scale_h,
                            const std::uint16_t* zero_h, float* acc) {
  std::size_t m = 0;
  if (!int8_logits_available() || group_size == 0 || !int8_geometry(D, bits, m)) return false;
  const std::size_t max_sets = (std::min(group_size, n) + 3) / 4;
  thread_local std::vector<std::uint8_t> inter;  // [sets][m / 16][64] (m = 64 only)
  thread_local std::vector<std::int32_t> pk;     // [2][kQueries][sets]
  if (m == 64) inter.resize(max_sets * m * 4);
  pk.resize(2 * kQueries * max_sets);
  Split4 sp;
  for (std::size_t r0 = 0; r0 < n; r0 += group_size) {
    const std::size_t gi = r0 / group_size, cnt = std::min(group_size, n - r0), sets = (cnt + 3) / 4;
    const std::uint8_t* rows = packed + r0 * m;
    prefetch_group(packed, scale_h, zero_h, gi, group_size, n, m, D);
    if (m == 64) interleave_rows(rows, cnt, m, inter.data());
    for (std::size_t m0 = 0; m0 < M; m0 += kQueries) {
      const int nq = static_cast<int>(std::min<std::size_t>(kQueries, M - m0));
      for (int i = nq; i < kQueries; ++i) {  // padding queries: no weight (real ones write every word)
        std::fill_n(pk.data() + static_cast<std::size_t>(i) * sets, sets, 0);
        std::fill_n(pk.data() + (kQueries + static_cast<std::size_t>(i)) * sets, sets, 0);
      }
      if (nq == kQueries && cnt == 32) {
        split_probs<true>(p + m0 * ld + r0, ld, nq, cnt, sets, pk.data(), pk.data() + kQueries * sets, sp);
      } else {
        split_probs<false>(p + m0 * ld + r0, ld, nq, cnt, sets, pk.data(), pk.data() + kQueries * sets, sp);
      }
      float* a = acc + m0 * D;
      const std::uint16_t* sc = scale_h + gi * D;
      const std::uint16_t* ze = zero_h + gi * D;
      switch (8 / bits) {
        case 4: accumulate_group<4>(rows, cnt, m, inter.data(), pk.data(), sp, nq, D, sc, ze, a); break;
        case 2: accumulate_group<2>(rows, cnt, m, inter.data(), pk.data(), sp, nq, D, sc, ze, a); break;
        default: accumulate_group<1>(rows, cnt, m, inter.data(), pk.data(), sp, nq, D, sc, ze, a); break;
      }
    }
  }
  return true;
}

namespace {
KVSLIM_INT8_TARGET void merge_rows(const float* hi, std::size_t ld_hi, const float* lo, std::size_t ld_lo,
                                   const std::uint8_t* mask_bits, std::size_t M, std::size_t n, float* out,
                                   std::size_t ld) {
  for (std::size_t m0 = 0; m0 < M; ++m0) {
    const float* h = hi + m0 * ld_hi;
    const float* l = lo + m0 * ld_lo;
    float* o = out + m0 * ld;
    std::size_t nh = 0, nl = 0;
    for (std::size_t s0 = 0; s0 < n; s0 += 16) {
      const std::size_t here = std::min<std::size_t>(16, n - s0);
      const auto valid = static_cast<__mmask16>(here == 16 ? 0xFFFF : (1u << here) - 1);
      unsigned bitsv = mask_bits[s0 / 8];
      if (here > 8) bitsv |= static_cast<unsigned>(mask_bits[s0 / 8 + 1]) << 8;
      const auto from_hi = static_cast<__mmask16>(bitsv & valid);
      const auto from_lo = static_cast<__mmask16>(~bitsv & valid);
      const unsigned take_hi = static_cast<unsigned>(__builtin_popcount(from_hi));
      const unsigned take_lo = static_cast<unsigned>(here) - take_hi;
      // Masked loads read only the rows each set still has; expand places them in token order.
      const __m512 vh = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << take_hi) - 1), h + nh);
      const __m512 vl = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << take_lo) - 1), l + nl);
      const __m512 v = _mm512_mask_expand_ps(_mm512_maskz_expand_ps(from_hi, vh), from_lo, vl);
      _mm512_mask_storeu_ps(o + s0, valid, v);
      nh += take_hi;
      nl += take_lo;
    }
  }
}

}  // namespace

bool merge_by_mask_int8(const float* hi, std::size_t ld_hi, const float* lo, std::size_t ld_lo,
                        const std::uint8_t* mask_bits, std::size_t M, std::size_t n, float* out, std::size_t ld) {
  if (!int8_logits_available()) return false;
  merge_rows(hi, ld_hi, lo, ld_lo, mask_bits, M, n, out, ld);
  return true;
}

}  // namespace kvslim::attend
