// Scores of packed key codes by integer dot products (AVX-512 VNNI, vpdpbusd: 64 u8 x s8 products
// per instruction, four times the fp32 FMA's work per instruction). The query (already multiplied
// by the group's per-channel key scale) is split into two int8 vectors, q ~ s1 * hi + s2 * lo with
// lo the rounded residual, so the product carries a relative error of about 2^-15 -- far below the
// fp16 rounding of the stored rows -- while the codes never leave their packed bytes.
//
// A packed row of m = D * bits / 8 bytes holds element e at byte e % m, bits (e / m) * bits: "sub-
// chunk" k of the row (elements [k*m, (k+1)*m)) is the row's bytes shifted right by k * bits and
// masked. With m in {16, 32, 64}, 64 / m consecutive rows fill one 512-bit register, each sub-chunk
// of the query is replicated into every row slot, and four query vectors (the query heads of one
// KV head, padded with zeros) are reduced together by a transposing add tree: per 128-bit block the
// four queries' partial sums, one block per 16 bytes of row.
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
#include <vector>

#include "attend/attend_kernels.h"
#include "quant/quant_kernels.h"

namespace kvslim::attend {
namespace {

// KVSLIM_NO_INT8_ATTEND=1 turns the integer path off (measurements against the fp32 kernels).
std::atomic<bool> g_int8_enabled{std::getenv("KVSLIM_NO_INT8_ATTEND") == nullptr};

bool cpu_has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

constexpr int kQueries = 4;  // query vectors per pass (GQA groups of 1-4 heads; larger ones loop)

// Writes query row q * scale (D floats each, D a multiple of 16) as int8 hi and lo parts
// (q[d] * scale[d] ~ s1 * hi[d] + s2 * lo[d], lo the rounded residual) straight into the replicated
// chunk layout: element d goes to byte (d % m) of row slot r (r < R) of chunk d / m, for hi at `hi`
// and lo at `lo`. Returns q . zero (the group's offset term of every score).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) float split_query(
    const float* q, const float* scale, const float* zero, std::size_t D, std::size_t m, int R, std::uint8_t* hi,
    std::uint8_t* lo, float& s1, float& s2) {
  alignas(64) float qs[256];  // q * scale (D <= 256)
  __m512 vmax = _mm512_setzero_ps(), vbias = _mm512_setzero_ps();
  for (std::size_t d = 0; d < D; d += 16) {
    const __m512 x = _mm512_loadu_ps(q + d);
    const __m512 y = _mm512_mul_ps(x, _mm512_load_ps(scale + d));
    _mm512_store_ps(qs + d, y);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(y));
    vbias = _mm512_fmadd_ps(x, _mm512_load_ps(zero + d), vbias);
  }
  const float amax = _mm512_reduce_max_ps(vmax), bias = _mm512_reduce_add_ps(vbias);
  if (!(amax > 0.0f) || !std::isfinite(amax)) {  // zero (or broken) query: every product 0
    s1 = s2 = 0.0f;
    for (std::size_t k = 0; k * m < D; ++k) {
      std::memset(hi + k * 64, 0, 64);
      std::memset(lo + k * 64, 0, 64);
    }
    return bias;
  }
  s1 = amax / 127.0f;
  s2 = s1 / 254.0f;  // the residual is within s1 / 2 = 127 * s2
  const __m512 inv1 = _mm512_set1_ps(1.0f / s1), inv2 = _mm512_set1_ps(1.0f / s2), vs1 = _mm512_set1_ps(s1);
  for (std::size_t d = 0; d < D; d += 16) {
    const __m512 x = _mm512_load_ps(qs + d);
    const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(x, inv1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i hq = _mm512_cvtps_epi32(h);
    const __m512i lq = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(h, vs1, x), inv2));
    const __m128i h8 = _mm512_cvtsepi32_epi8(hq), l8 = _mm512_cvtsepi32_epi8(lq);
    const std::size_t chunk = d / m, at = d % m;
    if (m == 16) {  // the 16 bytes fill every row slot of the chunk: one 512-bit store each
      _mm512_store_si512(hi + chunk * 64, _mm512_broadcast_i32x4(h8));
      _mm512_store_si512(lo + chunk * 64, _mm512_broadcast_i32x4(l8));
      continue;
    }
    for (int r = 0; r < R; ++r) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + chunk * 64 + static_cast<std::size_t>(r) * m + at), h8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + chunk * 64 + static_cast<std::size_t>(r) * m + at), l8);
    }
  }
  return bias;
}

// [q0, q1, q2, q3] partial sums per 128-bit block of the four accumulators.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline __m512i reduce4(__m512i a0, __m512i a1,
                                                                                       __m512i a2, __m512i a3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// Block b of the result holds, for the row slot it ends, the four queries' dot products.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline __m512i fold_blocks(__m512i t) {
  if constexpr (R <= 2) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (R == 1) t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return t;
}

// R rows per register (m = 64 / R bytes a row), K sub-chunks (bits = 8 / K).
template <int R, int K>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void logits_rows(
    const std::uint8_t* qv /* [2][kQueries][K][64] */, const float* s /* [2][kQueries] */, const float* bias,
    int nq, const std::uint8_t* packed, std::size_t n, const std::uint32_t* idx, float* logits, std::size_t ld) {
  constexpr std::size_t m = 64 / R;
  constexpr int bits = 8 / K;
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  // Per 128-bit block: [s_q0, s_q1, s_q2, s_q3] (the scales) and the biases.
  alignas(16) float b4[4] = {}, s1v[4] = {}, s2v[4] = {};
  for (int i = 0; i < nq; ++i) {
    b4[i] = bias[i];
    s1v[i] = s[i];
    s2v[i] = s[kQueries + i];
  }
  const __m512 vs1 = _mm512_broadcast_f32x4(_mm_load_ps(s1v));
  const __m512 vs2 = _mm512_broadcast_f32x4(_mm_load_ps(s2v));
  const __m512 vb = _mm512_broadcast_f32x4(_mm_load_ps(b4));
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
    if (R > 1 && idx == nullptr && here == static_cast<std::size_t>(R)) {
      // Consecutive columns: transpose to [query][row slot] and store each query's R logits at
      // once (R = 4: 16 scalar stores become 4 of 128 bits).
      _mm512_store_ps(out, _mm512_permutexvar_ps(by_query, f));
      for (int i = 0; i < nq; ++i) {
        std::memcpy(logits + static_cast<std::size_t>(i) * ld + r0, out + i * R, R * sizeof(float));
      }
      continue;
    }
    _mm512_store_ps(out, f);
    for (std::size_t r = 0; r < here; ++r) {
      const float* o = out + (r * (4 / R) + (4 / R - 1)) * 4;  // the block that ends row slot r
      const std::size_t col = idx != nullptr ? idx[r0 + r] : r0 + r;
      for (int i = 0; i < nq; ++i) logits[static_cast<std::size_t>(i) * ld + col] = o[i];
    }
  }
}

}  // namespace

bool int8_logits_available() { return cpu_has_vnni() && g_int8_enabled.load(std::memory_order_relaxed); }

void set_int8_logits_enabled(bool enabled) { g_int8_enabled.store(enabled, std::memory_order_relaxed); }

bool logits_packed_int8(const float* q, const std::uint16_t* scale_h, const std::uint16_t* zero_h,
                        std::size_t group_size, std::size_t M, std::size_t D, const std::uint8_t* packed, int bits,
                        std::size_t n, const std::uint32_t* idx, float* logits, std::size_t ld) {
  if (!int8_logits_available() || group_size == 0 || D > 256) return false;
  if (bits != 2 && bits != 4 && bits != 8) return false;  // one bit plane, at most 4 sub-chunks
  const std::size_t m = D * static_cast<std::size_t>(bits) / 8;
  if (D * static_cast<std::size_t>(bits) % 8 != 0 || (m != 16 && m != 32 && m != 64)) return false;
  const int K = 8 / bits, R = static_cast<int>(64 / m);
  // [2][kQueries][K][64] replicated query chunks, 64-byte aligned.
  alignas(64) std::uint8_t qv[2 * kQueries * 4 * 64];
  float s[2 * kQueries], b[kQueries];
  for (std::size_t r0 = 0; r0 < n; r0 += group_size) {
    const std::size_t gi = r0 / group_size, cnt = std::min(group_size, n - r0);
    alignas(64) float sc[256], ze[256];  // the group's params as fp32, once for all its queries
    quant::simd_kernels().params_to_f32(scale_h + gi * D, zero_h + gi * D, D, sc, ze);
    const std::uint8_t* rows = packed + r0 * m;
    const std::uint32_t* cols = idx != nullptr ? idx + r0 : nullptr;
    for (std::size_t m0 = 0; m0 < M; m0 += kQueries) {
      const int nq = static_cast<int>(std::min<std::size_t>(kQueries, M - m0));
      std::fill(s, s + 2 * kQueries, 0.0f);
      std::fill(b, b + kQueries, 0.0f);
      // split_query writes every byte of a real query's chunks (R row slots of m bytes = 64); the
      // padding queries' chunks are zeroed.
      for (int i = nq; i < kQueries; ++i) {
        for (int h = 0; h < 2; ++h) {
          std::memset(qv + ((static_cast<std::size_t>(h) * kQueries + static_cast<std::size_t>(i)) * K) * 64, 0,
                      static_cast<std::size_t>(K) * 64);
        }
      }
      for (int i = 0; i < nq; ++i) {
        const std::size_t at = static_cast<std::size_t>(i) * static_cast<std::size_t>(K) * 64;
        b[i] = split_query(q + (m0 + static_cast<std::size_t>(i)) * D, sc, ze, D, m, R, qv + at,
                           qv + static_cast<std::size_t>(kQueries) * static_cast<std::size_t>(K) * 64 + at, s[i],
                           s[kQueries + i]);
      }
      float* out = logits + m0 * ld + (idx != nullptr ? 0 : r0);
      switch (R * 10 + K) {
        case 14: logits_rows<1, 4>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 2-bit, D = 256
        case 12: logits_rows<1, 2>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 4-bit, D = 128
        case 11: logits_rows<1, 1>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 8-bit, D = 64
        case 24: logits_rows<2, 4>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 2-bit, D = 128
        case 22: logits_rows<2, 2>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 4-bit, D = 64
        case 21: logits_rows<2, 1>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 8-bit, D = 32
        case 44: logits_rows<4, 4>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 2-bit, D = 64
        case 42: logits_rows<4, 2>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 4-bit, D = 32
        case 41: logits_rows<4, 1>(qv, s, b, nq, rows, cnt, cols, out, ld); break;  // 8-bit, D = 16
        default: return false;
      }
    }
  }
  return true;
}

}  // namespace kvslim::attend

// ------------------------------------------------------------------------------------------------
// Values: acc[m, c] += sum_r p[m, r] * code[r, c] by vpdpbusd. A lane of vpdpbusd sums four byte
// products, so four rows' codes of one channel must sit side by side: the packed bytes of each
// set of four rows are interleaved once (byte i of rows r..r+3 -> one 32-bit lane), after which
// sub-chunk k of every lane is a shift and a mask away, as for the keys. The probabilities are
// split like the queries (p ~ s1 * hi + s2 * lo) and broadcast four rows at a time.
namespace kvslim::attend {
namespace {

// inter [sets][m / 16][64]: for each 16-byte column of the rows, 16 lanes of (row0, row1, row2, row3).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void interleave_rows(const std::uint8_t* packed,
                                                                                     std::size_t n, std::size_t m,
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

template <int K>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void accumulate_sets(
    const std::uint8_t* inter, std::size_t sets, std::size_t m, const std::int32_t* pk /* [2][kQueries][sets] */,
    const float* s /* [2][kQueries] */, int nq, std::size_t D, float* acc /* [nq, D] */) {
  constexpr int bits = 8 / K;
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  const std::int32_t* hi = pk;
  const std::int32_t* lo = pk + kQueries * sets;
  for (int k = 0; k < K; ++k) {
    for (std::size_t col = 0; col < m; col += 16) {
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
      const std::uint8_t* base = inter + (col / 16) * 64;
      for (std::size_t t = 0; t < sets; ++t) {
        const __m512i v = _mm512_loadu_si512(base + t * m * 4);
        const __m512i c = k == 0 ? _mm512_and_si512(v, mask) : _mm512_and_si512(_mm512_srli_epi16(v, k * bits), mask);
        h0 = _mm512_dpbusd_epi32(h0, c, _mm512_set1_epi32(hi[0 * sets + t]));
        h1 = _mm512_dpbusd_epi32(h1, c, _mm512_set1_epi32(hi[1 * sets + t]));
        h2 = _mm512_dpbusd_epi32(h2, c, _mm512_set1_epi32(hi[2 * sets + t]));
        h3 = _mm512_dpbusd_epi32(h3, c, _mm512_set1_epi32(hi[3 * sets + t]));
        l0 = _mm512_dpbusd_epi32(l0, c, _mm512_set1_epi32(lo[0 * sets + t]));
        l1 = _mm512_dpbusd_epi32(l1, c, _mm512_set1_epi32(lo[1 * sets + t]));
        l2 = _mm512_dpbusd_epi32(l2, c, _mm512_set1_epi32(lo[2 * sets + t]));
        l3 = _mm512_dpbusd_epi32(l3, c, _mm512_set1_epi32(lo[3 * sets + t]));
      }
      const __m512i hs[4] = {h0, h1, h2, h3}, ls[4] = {l0, l1, l2, l3};
      const std::size_t channel = static_cast<std::size_t>(k) * m + col;  // lanes: channels channel..+15
      for (int i = 0; i < nq; ++i) {
        float* a = acc + static_cast<std::size_t>(i) * D + channel;
        const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hs[i]), _mm512_set1_ps(s[i]),
                                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(ls[i]), _mm512_set1_ps(s[kQueries + i]),
                                                         _mm512_loadu_ps(a)));
        _mm512_storeu_ps(a, f);
      }
    }
  }
}

// One row of probabilities (n values >= 0) as int8 hi/lo, four rows per int32 (row 4t + j in byte
// j of word t); every byte of the `sets` words is written (zeros past n).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void split_probs(const float* p, std::size_t n,
                                                                                 std::size_t sets, std::int32_t* hi,
                                                                                 std::int32_t* lo, float& s1,
                                                                                 float& s2, float& sum) {
  const std::size_t bytes = sets * 4;
  auto tail = [](std::size_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1); };
  __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
  for (std::size_t r = 0; r < n; r += 16) {
    const __m512 x = _mm512_maskz_loadu_ps(tail(n - r), p + r);
    vmax = _mm512_max_ps(vmax, x);
    vsum = _mm512_add_ps(vsum, x);
  }
  const float pmax = _mm512_reduce_max_ps(vmax);
  sum = _mm512_reduce_add_ps(vsum);
  auto* h8 = reinterpret_cast<std::int8_t*>(hi);
  auto* l8 = reinterpret_cast<std::int8_t*>(lo);
  if (!(pmax > 0.0f) || !std::isfinite(pmax)) {
    std::memset(h8, 0, bytes);
    std::memset(l8, 0, bytes);
    s1 = s2 = 0.0f;
    return;
  }
  s1 = pmax / 127.0f;
  s2 = s1 / 254.0f;
  const __m512 inv1 = _mm512_set1_ps(1.0f / s1), inv2 = _mm512_set1_ps(1.0f / s2), vs1 = _mm512_set1_ps(s1);
  for (std::size_t r = 0; r < bytes; r += 16) {
    const __m512 x = r < n ? _mm512_maskz_loadu_ps(tail(n - r), p + r) : _mm512_setzero_ps();
    const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(x, inv1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i hq = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h));
    const __m128i lq = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(h, vs1, x), inv2)));
    const __mmask16 keep = tail(bytes - r);
    _mm_mask_storeu_epi8(h8 + r, keep, hq);
    _mm_mask_storeu_epi8(l8 + r, keep, lq);
  }
}

}  // namespace

bool accumulate_packed_int8(const float* p, std::size_t ld, std::size_t M, const std::uint8_t* packed, int bits,
                            std::size_t n, std::size_t D, float* acc, float* psum) {
  if (!int8_logits_available()) return false;
  if (bits != 2 && bits != 4 && bits != 8) return false;
  const std::size_t m = D * static_cast<std::size_t>(bits) / 8;
  if (D * static_cast<std::size_t>(bits) % 8 != 0 || (m != 16 && m != 32 && m != 64)) return false;
  if (n == 0) {
    std::fill(psum, psum + M, 0.0f);
    return true;
  }
  const std::size_t sets = (n + 3) / 4;
  thread_local std::vector<std::uint8_t> inter;   // [sets][m / 16][64]
  thread_local std::vector<std::int32_t> pk;      // [2][kQueries][sets]
  inter.resize(sets * m * 4);
  pk.resize(2 * kQueries * sets);
  interleave_rows(packed, n, m, inter.data());
  float s[2 * kQueries];
  for (std::size_t m0 = 0; m0 < M; m0 += kQueries) {
    const int nq = static_cast<int>(std::min<std::size_t>(kQueries, M - m0));
    std::fill(s, s + 2 * kQueries, 0.0f);
    for (int i = nq; i < kQueries; ++i) {  // padding queries: no weight (real ones write every word)
      std::fill_n(pk.data() + static_cast<std::size_t>(i) * sets, sets, 0);
      std::fill_n(pk.data() + (kQueries + static_cast<std::size_t>(i)) * sets, sets, 0);
    }
    for (int i = 0; i < nq; ++i) {
      split_probs(p + (m0 + static_cast<std::size_t>(i)) * ld, n, sets, pk.data() + static_cast<std::size_t>(i) * sets,
                  pk.data() + (kQueries + static_cast<std::size_t>(i)) * sets, s[i], s[kQueries + i],
                  psum[m0 + static_cast<std::size_t>(i)]);
    }
    float* a = acc + m0 * D;
    switch (8 / bits) {
      case 4: accumulate_sets<4>(inter.data(), sets, m, pk.data(), s, nq, D, a); break;
      case 2: accumulate_sets<2>(inter.data(), sets, m, pk.data(), s, nq, D, a); break;
      default: accumulate_sets<1>(inter.data(), sets, m, pk.data(), s, nq, D, a); break;
    }
  }
  return true;
}

}  // namespace kvslim::attend
