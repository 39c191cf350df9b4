// Block-quantized gemv and dequantization kernels (engine/quant_gemv.h), compiled for every target
// Highway knows and chosen at run time. x86 targets (AVX2, AVX3, AVX3_DL) use 256-bit integer dot
// products on the raw vectors (`.raw` of Highway's types is not needed: the kernels are written on
// the intrinsics each target's attributes enable); the other targets a portable loop with the same
// arithmetic. HWY_WANT_AVX3_DL is set for this library (CMake), so VNNI machines get `vpdpbusd`.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "engine/quant_gemv.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/gguf.h"
#include "engine/quant_gemv.h"
#include "kvslim/dtype.h"

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#include <immintrin.h>
#endif

#ifndef KVSLIM_QGEMV_LAYOUT_ONCE  // this file is compiled once per target: the layouts once
#define KVSLIM_QGEMV_LAYOUT_ONCE
namespace kvslim::engine::qgemv {
// The interleaved layouts (quant_gemv.h): bytes of a unit (16 rows' block or super-block), and
// where a Q4_Kx16 / Q6_Kx16 unit's parts start.
constexpr std::size_t kQ4x16Unit = 288;
constexpr std::size_t kQ4Kx16Unit = 2368, kQ4KxMin = 32, kQ4KxScales = 64, kQ4KxMins = 192, kQ4KxCodes = 320;
constexpr std::size_t kQ6Kx16Unit = 3360, kQ6KxScales = 32, kQ6KxCodes = 288;
}  // namespace kvslim::engine::qgemv
#endif

HWY_BEFORE_NAMESPACE();
namespace kvslim::engine::qgemv {
namespace HWY_NAMESPACE {

inline float Half(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return _cvtsh_ss(h);  // F16C
#else
  return fp16_to_f32(h);
#endif
}

// 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 packed bytes at s).
inline void ScaleMinK4(const std::uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#undef KVSLIM_QGEMV_X86  // this file is compiled once per target
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define KVSLIM_QGEMV_X86 1
#else
#define KVSLIM_QGEMV_X86 0
#endif

#if KVSLIM_QGEMV_X86
// ---------------------------------------------------------------------------------------------
// x86: 32 codes per 256-bit vector.

// acc + per-4-byte sums of u[i] * s[i] (u unsigned, s signed). Without VNNI the pair sums go
// through int16: exact while |u| * 127 * 2 < 32768, i.e. u <= 128 (every caller's codes are).
HWY_INLINE __m256i DotU8S8(__m256i acc, __m256i u, __m256i s) {
#if HWY_TARGET == HWY_AVX3_DL
  // The EVEX (AVX512_VNNI + VL) encoding, written out: Highway 1.0's AVX3_DL target string enables
  // "avxvnni", so GCC encodes the intrinsic as AVX-VNNI ({vex} vpdpbusd), which AVX-512 VNNI CPUs
  // need not have (this machine's does not: SIGILL), and it names no avx512vnni for the zmm form.
  __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

HWY_INLINE float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

HWY_INLINE __m256i Load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Blocks [0, nb) of `row`, the activation's blocks from `x0` on.
float DotQ8_0(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb, std::size_t x0 = 0) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  const std::int8_t* xq = x.q.data() + 32 * x0;
  const float* xd = x.d.data() + x0;
  std::size_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const std::uint8_t* b0 = row + 34 * b;
    const std::uint8_t* b1 = b0 + 34;
    const __m256i w0 = Load32(b0 + 2), w1 = Load32(b1 + 2);
    const __m256i p0 = DotU8S8(zero, _mm256_abs_epi8(w0), _mm256_sign_epi8(Load32(xq + 32 * b), w0));
    const __m256i p1 = DotU8S8(zero, _mm256_abs_epi8(w1), _mm256_sign_epi8(Load32(xq + 32 * b + 32), w1));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(Half(b0) * xd[b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(Half(b1) * xd[b + 1]), acc1);
  }
  for (; b < nb; ++b) {
    const std::uint8_t* b0 = row + 34 * b;
    const __m256i w0 = Load32(b0 + 2);
    const __m256i p0 = DotU8S8(zero, _mm256_abs_epi8(w0), _mm256_sign_epi8(Load32(xq + 32 * b), w0));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(Half(b0) * xd[b]), acc0);
  }
  return HSum(_mm256_add_ps(acc0, acc1));
}

// Q4_0 codes q in 0..15 stand for q - 8: dot(q - 8, x) = dot(q, x) - 8 * sum(x).
HWY_INLINE __m256i Q4_0Codes(const std::uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

float DotQ4_0(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb, std::size_t x0 = 0) {
  const std::int8_t* xq = x.q.data() + 32 * x0;
  const float* xd = x.d.data() + x0;
  const float* xds = x.ds.data() + x0;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  float corr = 0;
  std::size_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const std::uint8_t* b0 = row + 18 * b;
    const std::uint8_t* b1 = b0 + 18;
    const float d0 = Half(b0), d1 = Half(b1);
    const __m256i p0 = DotU8S8(zero, Q4_0Codes(b0 + 2), Load32(xq + 32 * b));
    const __m256i p1 = DotU8S8(zero, Q4_0Codes(b1 + 2), Load32(xq + 32 * b + 32));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xd[b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * xd[b + 1]), acc1);
    corr += d0 * xds[b] + d1 * xds[b + 1];
  }
  for (; b < nb; ++b) {
    const std::uint8_t* b0 = row + 18 * b;
    const float d0 = Half(b0);
    const __m256i p0 = DotU8S8(zero, Q4_0Codes(b0 + 2), Load32(xq + 32 * b));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * xd[b]), acc0);
    corr += d0 * xds[b];
  }
  return HSum(_mm256_add_ps(acc0, acc1)) - 8.0f * corr;
}

// Q4_K (bits 4) and Q5_K (bits 5): sub-block j of super-block i is activation block 8i + j;
// x = d * sc * q - dmin * m, so dot = sum_j d * sc_j * dot(q, x_j) - dmin * m_j * sum(x_j).
template <int kBits>
float DotQK_MinMax(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  constexpr std::size_t kBlockBytes = kBits == 4 ? 144 : 176;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
  float corr = 0;
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + kBlockBytes * i;
    const float d = Half(blk), dmin = Half(blk + 2);
    const std::uint8_t* scales = blk + 4;
    const std::uint8_t* qs = blk + 16 + (kBits == 5 ? 32 : 0);
    __m256i qh = zero;
    if constexpr (kBits == 5) qh = Load32(blk + 16);
    const std::size_t b = 8 * i;
    float mins = 0;
    for (int j = 0; j < 4; ++j) {
      int sc0, m0, sc1, m1;
      ScaleMinK4(scales, 2 * j, sc0, m0);
      ScaleMinK4(scales, 2 * j + 1, sc1, m1);
      const __m256i q = Load32(qs + 32 * j);
      __m256i lo = _mm256_and_si256(q, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (kBits == 5) {
        const __m256i mlo = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
        const __m256i mhi = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mlo), mlo), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mhi), mhi), bit4));
      }
      const std::size_t b0 = b + 2 * j, b1 = b0 + 1;
      const __m256i p0 = DotU8S8(zero, lo, Load32(x.q.data() + 32 * b0));
      const __m256i p1 = DotU8S8(zero, hi, Load32(x.q.data() + 32 * b1));
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d * static_cast<float>(sc0) * x.d[b0]), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d * static_cast<float>(sc1) * x.d[b1]), acc1);
      mins += static_cast<float>(m0) * x.ds[b0] + static_cast<float>(m1) * x.ds[b1];
    }
    corr += dmin * mins;
  }
  return HSum(_mm256_add_ps(acc0, acc1)) - corr;
}

// Q6_K: codes 0..63 stand for q - 32, one int8 scale per 16 values; the 32 values of activation
// block b are two scale groups: int32 lanes 0-3 sum its first 16 products, lanes 4-7 the rest.
float DotQ6_K(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
  float corr = 0;
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + 210 * i;
    const float d = Half(blk + 208);
    const auto* sc = reinterpret_cast<const std::int8_t*>(blk + 192);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = Load32(blk + 64 * h), l1 = Load32(blk + 64 * h + 32), qh = Load32(blk + 128 + 32 * h);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)),
      };
      for (int k = 0; k < 4; ++k) {
        const std::size_t b = 8 * i + 4 * h + k;
        const int s0 = sc[8 * h + 2 * k], s1 = sc[8 * h + 2 * k + 1];
        const __m256i p = DotU8S8(zero, u[k], Load32(x.q.data() + 32 * b));
        const float dd = d * x.d[b];
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(dd * static_cast<float>(s1)), _mm_set1_ps(dd * static_cast<float>(s0)));
        if (k % 2 == 0) {
          acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc0);
        } else {
          acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc1);
        }
        corr += dd * static_cast<float>(s0 * x.s16[2 * b] + s1 * x.s16[2 * b + 1]);
      }
    }
  }
  return HSum(_mm256_add_ps(acc0, acc1)) - 32.0f * corr;
}

#if HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: two activation blocks per zmm, scales for 8 blocks computed as one vector and
// spread to the lanes with one permute per pair (no per-block scalar work in the inner loop).

// Software prefetch of the weight bytes kPrefetchBytes ahead of the `bytes` a step reads (the
// rows are one sequential stream per thread; the hardware prefetcher alone left decode waiting on
// memory: 1-thread decode of the 1 B Q4_0 model 30-33 tokens/s without, 34-38 with 1, 2 or 4 KB).
// 16 KB ahead into L2 (T1) rather than 2 KB into L1 (T0) keeps more lines in flight: decode of the
// 1 B Q4_K_M file after 128 tokens, 2 threads, 49.7 / 51.3 -> 61.0 / 56.6 tokens/s, 1 thread
// 33.2 / 33.3 -> 35.7 / 35.6 (alternated runs, same binary otherwise; docs/gguf.md, third run).
// Past the matrix's end a prefetch is a no-op (it never faults).
constexpr std::size_t kPrefetchBytes = 16384;
HWY_INLINE void PrefetchAhead(const std::uint8_t* p, std::size_t bytes) {
  for (std::size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + o), _MM_HINT_T1);
}

HWY_INLINE __m512i DotU8S8x64(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));  // EVEX: a zmm form has no VEX encoding
  return acc;
}

// acc + w (16 rows x 4 unsigned bytes) . the 4 signed bytes at p broadcast to every row.
HWY_INLINE __m512i DotBcast(__m512i acc, __m512i w, const std::int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const std::int32_t*>(p)));
  return acc;
}

// Lane index vectors: pair k of 8 blocks -> [2k x8, 2k+1 x8] (two contiguous blocks).
HWY_INLINE __m512i PairIndex(int k) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * k)), _mm256_set1_epi32(2 * k + 1), 1);
}
// [a x8, b x8].
HWY_INLINE __m512i PairIndexOf(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b), 1);
}

// fp16 scales of 8 blocks `stride` bytes apart (at p, p + stride, ...) as floats.
HWY_INLINE __m256 Scales8(const std::uint8_t* p, std::size_t stride) {
  std::uint16_t h[8];
  for (int k = 0; k < 8; ++k) std::memcpy(&h[k], p + k * stride, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// The fp16 scales of 8 Q4_0 blocks (offsets 0, 18, ..., 126: inside 128 bytes) with one two-source
// word permute instead of 8 scalar loads.
HWY_INLINE __m256 Scales8Q4_0(const std::uint8_t* p) {
  alignas(64) static constexpr std::int16_t kWords[32] = {0, 9, 18, 27, 36, 45, 54, 63};
  const __m512i idx = _mm512_load_si512(kWords);
  const __m512i lo = _mm512_loadu_si512(p), hi = _mm512_loadu_si512(p + 64);
  return _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(lo, idx, hi)));
}

// Q4_0, 8 blocks (144 bytes) per step: the 16 code bytes of 4 blocks gathered from their 72 bytes
// with one two-source byte permute (VBMI), so one zmm holds the low nibbles of 4 blocks and its
// shift the high nibbles; the activation's codes are pre-arranged to match (Q8Blocks::q_nib0).
// The int32 lanes 4k..4k+3 of the two products' sum are block k's: one convert, one scale permute
// and one FMA per 4 blocks.
HWY_INLINE __m512i GatherQ4_0Codes(const std::uint8_t* blk4, __m512i idx) {
  const __m512i lo = _mm512_loadu_si512(blk4);
  const __m512i hi = _mm512_maskz_loadu_epi8(0xffull, blk4 + 64);  // bytes 64..71 only: never past the row
  return _mm512_permutex2var_epi8(lo, idx, hi);
}

HWY_INLINE __m512i Q4_0GatherIndex() {
  alignas(64) std::uint8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = static_cast<std::uint8_t>(18 * (i / 16) + 2 + i % 16);
  return _mm512_load_si512(idx);
}

// Lane l of 16 -> scale 4g + l / 4.
HWY_INLINE __m512i QuadIndex(int g) {
  return _mm512_setr_epi32(4 * g, 4 * g, 4 * g, 4 * g, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 2,
                           4 * g + 2, 4 * g + 2, 4 * g + 2, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3);
}

float DotQ4_0Wide(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  __m256 corr = _mm256_setzero_ps();
  const __m512i m4x = _mm512_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i gather = Q4_0GatherIndex();
  const __m512i idx0 = QuadIndex(0), idx1 = QuadIndex(1);
  const std::int8_t* xn = x.q_nib0.data();
  std::size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const std::uint8_t* blk = row + 18 * b;
    PrefetchAhead(blk, 144);
    const __m256 dw = Scales8Q4_0(blk);
    const __m512 sv = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(x.d.data() + b)));
    corr = _mm256_fmadd_ps(dw, _mm256_loadu_ps(x.ds.data() + b), corr);
    const __m512i v0 = GatherQ4_0Codes(blk, gather), v1 = GatherQ4_0Codes(blk + 72, gather);
    const std::int8_t* xq = xn + 32 * b;
    __m512i p0 = DotU8S8x64(zero, _mm512_and_si512(v0, m4x), _mm512_loadu_si512(xq));
    p0 = DotU8S8x64(p0, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4x), _mm512_loadu_si512(xq + 64));
    __m512i p1 = DotU8S8x64(zero, _mm512_and_si512(v1, m4x), _mm512_loadu_si512(xq + 128));
    p1 = DotU8S8x64(p1, _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4x), _mm512_loadu_si512(xq + 192));
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(idx0, sv), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(idx1, sv), acc1);
  }
  if (b + 4 <= nb) {  // one group of 4 (rows of 12, 20, ... blocks: models/tiny's 384 columns)
    const std::uint8_t* blk = row + 18 * b;
    const __m128 dw = _mm_setr_ps(Half(blk), Half(blk + 18), Half(blk + 36), Half(blk + 54));
    const __m512 sv = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(x.d.data() + b)));
    corr = _mm256_add_ps(corr, _mm256_zextps128_ps256(_mm_mul_ps(dw, _mm_loadu_ps(x.ds.data() + b))));
    const __m512i v0 = GatherQ4_0Codes(blk, gather);
    const std::int8_t* xq = xn + 32 * b;
    __m512i p0 = DotU8S8x64(zero, _mm512_and_si512(v0, m4x), _mm512_loadu_si512(xq));
    p0 = DotU8S8x64(p0, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4x), _mm512_loadu_si512(xq + 64));
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(idx0, sv), acc0);
    b += 4;
  }
  float total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - 8.0f * HSum(corr);
  if (b < nb) total += DotQ4_0(row + 18 * b, x, nb - b, b);
  return total;
}

float DotQ8_0Wide(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb) {
  // Codes w + 128 as unsigned bytes (w ^ 0x80): dot(w, x) = dot(w + 128, x) - 128 * sum(x).
  __m512 acc = _mm512_setzero_ps();
  __m256 corr = _mm256_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  const __m512i idx[4] = {PairIndex(0), PairIndex(1), PairIndex(2), PairIndex(3)};
  std::size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const std::uint8_t* blk = row + 34 * b;
    PrefetchAhead(blk, 272);
    const __m256 dw = Scales8(blk, 34);
    const __m512 sv = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(x.d.data() + b)));
    corr = _mm256_fmadd_ps(dw, _mm256_loadu_ps(x.ds.data() + b), corr);
    for (int k = 0; k < 4; ++k) {
      const std::uint8_t* p0 = blk + 68 * k + 2;
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(Load32(p0)), Load32(p0 + 34), 1);
      const __m512i s = _mm512_loadu_si512(x.q.data() + 32 * (b + 2 * k));
      const __m512i p = DotU8S8x64(zero, _mm512_xor_si512(w, flip), s);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx[k], sv), acc);
    }
  }
  float total = _mm512_reduce_add_ps(acc) - 128.0f * HSum(corr);
  if (b < nb) total += DotQ8_0(row + 34 * b, x, nb - b, b);
  return total;
}

// Q4_K: the 8 sub-blocks of a super-block are 8 consecutive activation blocks; sub-blocks 2j and
// 2j+1 share 32 code bytes (low / high nibbles), which is exactly the contiguous 64 activation bytes.
// Q5_K (kBits 5) as Q4_K with bit 4 of each code from qh.
template <int kBits>
float DotQK_Wide(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  constexpr std::size_t kBlockBytes = kBits == 4 ? 144 : 176;
  __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
  __m256 corr = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
  const __m512i m4x = _mm512_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i idx[4] = {PairIndex(0), PairIndex(1), PairIndex(2), PairIndex(3)};
  // Q4_K: lanes 0-7 / 8-15 of the product of the low nibbles of qs[64h : 64h + 64] are sub-blocks
  // 4h and 4h + 2, of the high nibbles 4h + 1 and 4h + 3 (the activation in Q8Blocks::q_nibk order).
  const __m512i kidx[4] = {PairIndexOf(0, 2), PairIndexOf(1, 3), PairIndexOf(4, 6), PairIndexOf(5, 7)};
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + kBlockBytes * i;
    PrefetchAhead(blk, kBlockBytes);
    const std::uint8_t* qs = blk + 16 + (kBits == 5 ? 32 : 0);
    const float d = Half(blk), dmin = Half(blk + 2);
    // The 8 six-bit scales and mins, four at a time in 32-bit words (ScaleMinK4's layout):
    // scales 0-3 = w0 & 63, mins 0-3 = w1 & 63, scales 4-7 = (w2 & 15) | (w0 >> 6) << 4,
    // mins 4-7 = (w2 >> 4 & 15) | (w1 >> 6) << 4, per byte.
    std::uint32_t w[3];
    std::memcpy(w, blk + 4, 12);
    const std::uint32_t sc_lo = w[0] & 0x3f3f3f3fu, mn_lo = w[1] & 0x3f3f3f3fu;
    const std::uint32_t sc_hi = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    const std::uint32_t mn_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>((std::uint64_t{sc_hi} << 32) | sc_lo))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>((std::uint64_t{mn_hi} << 32) | mn_lo))));
    const std::size_t b = 8 * i;
    const __m512 sv = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), sc), _mm256_loadu_ps(x.d.data() + b)));
    corr = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mn), _mm256_loadu_ps(x.ds.data() + b), corr);
    if constexpr (kBits == 4) {
      const std::int8_t* xq = x.q_nibk.data() + 256 * i;
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * h);
        const __m512i plo = DotU8S8x64(zero, _mm512_and_si512(v, m4x), _mm512_loadu_si512(xq + 128 * h));
        const __m512i phi = DotU8S8x64(zero, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4x), _mm512_loadu_si512(xq + 128 * h + 64));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(plo), _mm512_permutexvar_ps(kidx[2 * h], sv), acc);
        acc2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(phi), _mm512_permutexvar_ps(kidx[2 * h + 1], sv), acc2);
      }
    } else {
      const __m256i qh = Load32(blk + 16);
      for (int j = 0; j < 4; ++j) {
        const __m256i q = Load32(qs + 32 * j);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i mlo = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
        const __m256i mhi = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mlo), mlo), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mhi), mhi), bit4));
        const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        const __m512i s = _mm512_loadu_si512(x.q.data() + 32 * (b + 2 * j));
        const __m512i p = DotU8S8x64(zero, u, s);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx[j], sv), acc);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2)) - HSum(corr);
}

// Q6_K: the 16 per-16 scales of a super-block times d and their activation block's scale as one
// zmm; each zmm of codes (two activation blocks) covers 4 of them, spread with one permute.
float DotQ6_KWide(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  __m512 acc = _mm512_setzero_ps(), corr = _mm512_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512i idx[4];
  for (int q = 0; q < 4; ++q) {
    idx[q] = _mm512_setr_epi32(4 * q, 4 * q, 4 * q, 4 * q, 4 * q + 1, 4 * q + 1, 4 * q + 1, 4 * q + 1, 4 * q + 2,
                               4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 3);
  }
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + 210 * i;
    PrefetchAhead(blk, 210);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
    const __m512 xd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(x.d.data() + 8 * i)));
    const __m512 sv = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(Half(blk + 208)), sc), xd);
    corr = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_loadu_si512(x.s16.data() + 16 * i)), corr);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = Load32(blk + 64 * h), l1 = Load32(blk + 64 * h + 32), qh = Load32(blk + 128 + 32 * h);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)),
      };
      for (int kk = 0; kk < 2; ++kk) {
        const __m512i zu = _mm512_inserti64x4(_mm512_castsi256_si512(u[2 * kk]), u[2 * kk + 1], 1);
        const __m512i s = _mm512_loadu_si512(x.q.data() + 32 * (8 * i + 4 * h + 2 * kk));
        const __m512i p = DotU8S8x64(zero, zu, s);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx[2 * h + kk], sv), acc);
      }
    }
  }
  return _mm512_reduce_add_ps(acc) - 32.0f * _mm512_reduce_add_ps(corr);
}
#endif

#else
// ---------------------------------------------------------------------------------------------
// Portable targets: the same sums, one code at a time.

inline std::int32_t DotI8(const std::int8_t* a, const std::int8_t* b, int n) {
  std::int32_t s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<std::int32_t>(a[i]) * b[i];
  return s;
}

float DotQ8_0(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb) {
  float acc = 0;
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* blk = row + 34 * b;
    acc += Half(blk) * x.d[b] *
           static_cast<float>(DotI8(reinterpret_cast<const std::int8_t*>(blk + 2), x.q.data() + 32 * b, 32));
  }
  return acc;
}

float DotQ4_0(const std::uint8_t* row, const Q8Blocks& x, std::size_t nb) {
  float acc = 0;
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* blk = row + 18 * b;
    std::int8_t w[32];
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<std::int8_t>((blk[2 + j] & 15) - 8);
      w[j + 16] = static_cast<std::int8_t>((blk[2 + j] >> 4) - 8);
    }
    acc += Half(blk) * x.d[b] * static_cast<float>(DotI8(w, x.q.data() + 32 * b, 32));
  }
  return acc;
}

template <int kBits>
float DotQK_MinMax(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  constexpr std::size_t kBlockBytes = kBits == 4 ? 144 : 176;
  float acc = 0;
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + kBlockBytes * i;
    const float d = Half(blk), dmin = Half(blk + 2);
    const std::uint8_t* qh = blk + 16;
    const std::uint8_t* qs = blk + 16 + (kBits == 5 ? 32 : 0);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ScaleMinK4(blk + 4, j, sc, m);
      std::int8_t w[32];
      for (int l = 0; l < 32; ++l) {
        int q = j % 2 == 0 ? qs[32 * (j / 2) + l] & 15 : qs[32 * (j / 2) + l] >> 4;
        if (kBits == 5) q |= ((qh[l] >> j) & 1) << 4;
        w[l] = static_cast<std::int8_t>(q);
      }
      const std::size_t b = 8 * i + static_cast<std::size_t>(j);
      acc += d * static_cast<float>(sc) * x.d[b] * static_cast<float>(DotI8(w, x.q.data() + 32 * b, 32)) -
             dmin * static_cast<float>(m) * x.ds[b];
    }
  }
  return acc;
}

float DotQ6_K(const std::uint8_t* row, const Q8Blocks& x, std::size_t n_super) {
  float acc = 0;
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* blk = row + 210 * i;
    const float d = Half(blk + 208);
    const auto* sc = reinterpret_cast<const std::int8_t*>(blk + 192);
    std::int8_t w[256];
    for (int e = 0; e < 256; ++e) {
      const std::uint8_t* ql = blk + 64 * (e / 128);
      const std::uint8_t* qh = blk + 128 + 32 * (e / 128);
      const int p = e % 128, l = p % 32, quarter = p / 32;
      const int low = ql[l + (quarter % 2) * 32];
      const int code = (quarter < 2 ? low & 15 : low >> 4) | (((qh[l] >> (2 * quarter)) & 3) << 4);
      w[e] = static_cast<std::int8_t>(code - 32);
    }
    for (int g = 0; g < 16; ++g) {
      const std::size_t b = 8 * i + static_cast<std::size_t>(g / 2);
      acc += d * static_cast<float>(sc[g]) * x.d[b] *
             static_cast<float>(DotI8(w + 16 * g, x.q.data() + 256 * i + 16 * g, 16));
    }
  }
  return acc;
}
#endif

// ---------------------------------------------------------------------------------------------
// Q4_0x16: Q4_0 matrices repacked at load (interleave, quant_gemv.h) so that one pass over
// the activation feeds 16 rows and each row's sum stays in its own int32 lane (no horizontal
// reduction, one sequential weight stream per thread). A 16-row group is nb = cols / 32 units of
// 288 bytes, unit b = block b of the 16 rows: their fp16 scales (32 bytes), then 4 chunks of 64
// bytes, chunk c = [row 0..15][the row's code bytes 4c..4c+3], whose low nibbles are the block's
// values 4c..4c+3 and high nibbles its values 16+4c..16+4c+3. Codes q in 0..15 stand for q - 8:
// each block's int32 sum is corrected in integers (- 8 * the activation block's code sum) before
// its one convert and FMA, so a row's value is sum_b float(dot(q - 8, x_b)) * (d_w * d_x), the
// order of llama.cpp's repacked kernels.
// 8 * (sum of activation block b's 32 codes).
HWY_INLINE std::int32_t Q4Offset(const Q8Blocks& x, std::size_t b) { return 8 * (x.s16[2 * b] + x.s16[2 * b + 1]); }

#if HWY_TARGET == HWY_AVX3_DL
// out[0..16) = the sum over units i < n of unit(i, acc), which accumulates unit i's 16 row
// products into acc: the group kernels' loop, on two alternating accumulators (two independent
// FMA chains).
template <typename Unit>
HWY_INLINE void SumUnitsTwoChains(std::size_t n, float* out, Unit&& unit) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + 2 <= n; i += 2) {
    unit(i, acc0);
    unit(i + 1, acc1);
  }
  if (i < n) unit(i, acc0);
  _mm512_storeu_ps(out, _mm512_add_ps(acc0, acc1));
}

// out[0..16) = the 16 rows of group g (nb units).
void GroupQ4_0x16(const std::uint8_t* g, const Q8Blocks& x, std::size_t nb, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  const std::int8_t* xq = x.q.data();
  auto unit = [&](std::size_t b, __m512& acc) {
    // No software prefetch: the repacked matrices sit on 2 MiB pages (gguf_model.cc), where the
    // hardware prefetchers follow the stream; PrefetchAhead's 16 KB into L2 was slower there
    // (decode of the 1 B Q4_0 file, alternated runs: 1 thread 47.4-47.9 -> 53.3-56.0 tok/s
    // without; 2 threads after 512 tokens, best of 6: 66.8 -> 69.8, median ~48 -> ~58).
    const std::uint8_t* u = g + kQ4x16Unit * b;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    const std::int8_t* q = xq + 32 * b;
    __m512i lo = zero, hi = zero;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(u + 32 + 64 * c);
      lo = DotBcast(lo, _mm512_and_si512(v, m4), q + 4 * c);
      hi = DotBcast(hi, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), q + 16 + 4 * c);
    }
    const __m512i p = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(Q4Offset(x, b)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[b])), acc);
  };
  SumUnitsTwoChains(nb, out, unit);
}

// Prefill: y[t * ldy + row0 + i] for NT tokens from t0 and the group's rows i < 16 in `m`; the
// group's 8 code vectors per unit are unpacked once for the NT tokens (the group's bytes stay in
// L1/L2 while the tokens stream past).
template <int NT>
void TileQ4_0x16(const std::uint8_t* g, std::size_t nb, const Q8Blocks* xs, std::size_t t0, float* y, std::size_t ldy,
                 std::size_t row0, __mmask16 m) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* u = g + kQ4x16Unit * b;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(u + 32 + 64 * c);
      lo[c] = _mm512_and_si512(v, m4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    for (int t = 0; t < NT; ++t) {
      const Q8Blocks& x = xs[t0 + t];
      const std::int8_t* q = x.q.data() + 32 * b;
      __m512i pl = DotBcast(zero, lo[0], q), ph = DotBcast(zero, hi[0], q + 16);
      for (int c = 1; c < 4; ++c) {
        pl = DotBcast(pl, lo[c], q + 4 * c);
        ph = DotBcast(ph, hi[c], q + 16 + 4 * c);
      }
      const __m512i p = _mm512_sub_epi32(_mm512_add_epi32(pl, ph), _mm512_set1_epi32(Q4Offset(x, b)));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[b])), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + row0, m, acc[t]);
}

#elif KVSLIM_QGEMV_X86
// AVX2 / AVX3: rows 0-7 and 8-15 of a chunk are its two 32-byte halves, one ymm of 8 int32 row
// sums each; the activation's 4 bytes broadcast per chunk.
void GroupQ4_0x16(const std::uint8_t* g, const Q8Blocks& x, std::size_t nb, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* u = g + kQ4x16Unit * b;
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)));
    const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16)));
    const std::int8_t* q = x.q.data() + 32 * b;
    __m256i p0 = zero, p1 = zero;
    for (int c = 0; c < 4; ++c) {
      std::int32_t a, h;
      std::memcpy(&a, q + 4 * c, 4);
      std::memcpy(&h, q + 16 + 4 * c, 4);
      const __m256i xl = _mm256_set1_epi32(a), xh = _mm256_set1_epi32(h);
      const __m256i v0 = Load32(u + 32 + 64 * c), v1 = Load32(u + 64 + 64 * c);
      p0 = DotU8S8(p0, _mm256_and_si256(v0, m4), xl);
      p0 = DotU8S8(p0, _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), xh);
      p1 = DotU8S8(p1, _mm256_and_si256(v1, m4), xl);
      p1 = DotU8S8(p1, _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), xh);
    }
    const __m256i off = _mm256_set1_epi32(Q4Offset(x, b));
    const __m256 s = _mm256_set1_ps(x.d[b]);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(p0, off)), _mm256_mul_ps(dw0, s), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(p1, off)), _mm256_mul_ps(dw1, s), acc1);
  }
  _mm256_storeu_ps(out, acc0);
  _mm256_storeu_ps(out + 8, acc1);
}

#else
// Portable: the same integer sums, one code at a time.
void GroupQ4_0x16(const std::uint8_t* g, const Q8Blocks& x, std::size_t nb, float* out) {
  for (int r = 0; r < 16; ++r) {
    float acc = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::uint8_t* u = g + kQ4x16Unit * b;
      const std::int8_t* q = x.q.data() + 32 * b;
      std::int32_t s = 0;
      for (int c = 0; c < 4; ++c) {
        for (int k = 0; k < 4; ++k) {
          const std::uint8_t byte = u[32 + 64 * c + 4 * r + k];
          s += static_cast<std::int32_t>(byte & 15) * q[4 * c + k] + static_cast<std::int32_t>(byte >> 4) * q[16 + 4 * c + k];
        }
      }
      acc += static_cast<float>(s - Q4Offset(x, b)) * (Half(u + 2 * r) * x.d[b]);
    }
    out[r] = acc;
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Q4_Kx16: Q4_K matrices repacked at load (interleave, quant_gemv.h). A unit (super-block i of a
// 16-row group, 2368 bytes): the rows' fp16 d and dmin, their 6-bit sub-block scales and mins as
// bytes [j][row], then per pair p of sub-blocks 8 chunks of 64 bytes, chunk c = [row 0..15][the
// row's code bytes 32p+4c..32p+4c+3] (low nibbles: sub-block 2p's values 4c..4c+3, high nibbles
// sub-block 2p+1's). With the q8_k activation (one scale dx per 256 values, Q8Blocks::format) a
// row's super-block is dx * (d * sum_j sc_j * dot(q_j, x_j) - dmin * sum_j m_j * sum(x_j)), both
// sums exact in int32 (at most 256 x 15 x 127 x 63 < 2^25), so a unit costs two converts and two
// FMAs for 16 rows, where the row-at-a-time kernel converts and scales every pair of sub-blocks:
// the integer folding of llama.cpp's q4_K kernels, on 16 rows at once.
// The sum of activation block b's 32 codes (a Q4_K sub-block's, for its min).
HWY_INLINE std::int32_t BlockCodeSum(const Q8Blocks& x, std::size_t b) { return x.s16[2 * b] + x.s16[2 * b + 1]; }

#if HWY_TARGET == HWY_AVX3_DL
// The 16 rows' scale (or min) bytes of sub-block j at p, as int32 lanes.
HWY_INLINE __m512i RowBytes16(const std::uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// sum_j m_j * sum(x_j) per row of unit u (super-block at activation block b0).
HWY_INLINE __m512i Q4KMinSums(const std::uint8_t* u, const Q8Blocks& x, std::size_t b0) {
  __m512i m = _mm512_mullo_epi32(RowBytes16(u + kQ4KxMins), _mm512_set1_epi32(BlockCodeSum(x, b0)));
  for (int j = 1; j < 8; ++j) {
    m = _mm512_add_epi32(m, _mm512_mullo_epi32(RowBytes16(u + kQ4KxMins + 16 * j), _mm512_set1_epi32(BlockCodeSum(x, b0 + j))));
  }
  return m;
}

// out[0..16) = the 16 rows of group g (n_super units).
void GroupQ4_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  auto unit = [&](std::size_t i, __m512& acc) {
    // No software prefetch, as for Q4_0x16: the repacked matrices sit on 2 MiB pages.
    const std::uint8_t* u = g + kQ4Kx16Unit * i;
    const std::int8_t* q = x.q.data() + 256 * i;
    __m512i isum = zero;
    for (int p = 0; p < 4; ++p) {
      const std::uint8_t* w = u + kQ4KxCodes + 512 * p;
      __m512i lo = zero, hi = zero;
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        lo = DotBcast(lo, _mm512_and_si512(v, m4), q + 64 * p + 4 * c);
        hi = DotBcast(hi, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), q + 64 * p + 32 + 4 * c);
      }
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(lo, RowBytes16(u + kQ4KxScales + 32 * p)));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(hi, RowBytes16(u + kQ4KxScales + 32 * p + 16)));
    }
    const __m512 dx = _mm512_set1_ps(x.d[8 * i]);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + kQ4KxMin)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc);
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Q4KMinSums(u, x, 8 * i)), _mm512_mul_ps(dmin, dx), acc);
  };
  SumUnitsTwoChains(n_super, out, unit);
}

// Prefill: as TileQ4_0x16, the 16 code vectors of a sub-block pair unpacked once for NT tokens.
template <int NT>
void TileQ4_Kx16(const std::uint8_t* g, std::size_t n_super, const Q8Blocks* xs, std::size_t t0, float* y, std::size_t ldy,
                 std::size_t row0, __mmask16 m) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* u = g + kQ4Kx16Unit * i;
    __m512i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = zero;
    for (int p = 0; p < 4; ++p) {
      const std::uint8_t* w = u + kQ4KxCodes + 512 * p;
      __m512i lo[8], hi[8];
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        lo[c] = _mm512_and_si512(v, m4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      const __m512i sl = RowBytes16(u + kQ4KxScales + 32 * p), sh = RowBytes16(u + kQ4KxScales + 32 * p + 16);
      for (int t = 0; t < NT; ++t) {
        const std::int8_t* q = xs[t0 + t].q.data() + 256 * i + 64 * p;
        __m512i pl = DotBcast(zero, lo[0], q), ph = DotBcast(zero, hi[0], q + 32);
        for (int c = 1; c < 8; ++c) {
          pl = DotBcast(pl, lo[c], q + 4 * c);
          ph = DotBcast(ph, hi[c], q + 32 + 4 * c);
        }
        isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(pl, sl), _mm512_mullo_epi32(ph, sh)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + kQ4KxMin)));
    for (int t = 0; t < NT; ++t) {
      const Q8Blocks& x = xs[t0 + t];
      const __m512 dx = _mm512_set1_ps(x.d[8 * i]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Q4KMinSums(u, x, 8 * i)), _mm512_mul_ps(dmin, dx), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + row0, m, acc[t]);
}

#elif KVSLIM_QGEMV_X86
// AVX2 / AVX3: rows 0-7 and 8-15 of a chunk are its two 32-byte halves. vpmaddubsw gives int16
// sums of code pairs (|.| <= 2 x 15 x 127); vpmaddwd against each row's sub-block scale held in
// both int16 halves of its lane multiplies and adds them in one step (exact: |.| <= 2 x 3810 x 63),
// so the scale costs no extra instruction per chunk (llama.cpp's AVX2 q4_K trick).
HWY_INLINE __m256i ScalePairs8(const std::uint8_t* p) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
}

void GroupQ4_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* u = g + kQ4Kx16Unit * i;
    const std::int8_t* q = x.q.data() + 256 * i;
    __m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const std::uint8_t* sc = u + kQ4KxScales + 32 * p;  // sub-block 2p: sc[0..16), 2p+1: sc[16..32)
      const __m256i sl0 = ScalePairs8(sc), sl1 = ScalePairs8(sc + 8), sh0 = ScalePairs8(sc + 16), sh1 = ScalePairs8(sc + 24);
      const std::uint8_t* w = u + kQ4KxCodes + 512 * p;
      for (int c = 0; c < 8; ++c) {
        std::int32_t a, h;
        std::memcpy(&a, q + 64 * p + 4 * c, 4);
        std::memcpy(&h, q + 64 * p + 32 + 4 * c, 4);
        const __m256i xl = _mm256_set1_epi32(a), xh = _mm256_set1_epi32(h);
        const __m256i v0 = Load32(w + 64 * c), v1 = Load32(w + 64 * c + 32);
        is0 = _mm256_add_epi32(is0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, m4), xl), sl0));
        is0 = _mm256_add_epi32(is0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), xh), sh0));
        is1 = _mm256_add_epi32(is1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, m4), xl), sl1));
        is1 = _mm256_add_epi32(is1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), xh), sh1));
      }
    }
    __m256i ms0 = _mm256_setzero_si256(), ms1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i bs = _mm256_set1_epi32(BlockCodeSum(x, 8 * i + j));
      const std::uint8_t* mn = u + kQ4KxMins + 16 * j;
      ms0 = _mm256_add_epi32(ms0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))), bs));
      ms1 = _mm256_add_epi32(ms1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 8))), bs));
    }
    const __m256 dx = _mm256_set1_ps(x.d[8 * i]);
    auto half = [&](int k) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16 * k))); };
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0), _mm256_mul_ps(half(0), dx), acc0);
    acc0 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms0), _mm256_mul_ps(half(2), dx), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1), _mm256_mul_ps(half(1), dx), acc1);
    acc1 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms1), _mm256_mul_ps(half(3), dx), acc1);
  }
  _mm256_storeu_ps(out, acc0);
  _mm256_storeu_ps(out + 8, acc1);
}

#else
// Portable: the same integer sums, one code at a time.
void GroupQ4_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  for (int r = 0; r < 16; ++r) {
    float acc = 0;
    for (std::size_t i = 0; i < n_super; ++i) {
      const std::uint8_t* u = g + kQ4Kx16Unit * i;
      const std::int8_t* q = x.q.data() + 256 * i;
      std::int32_t isum = 0, msum = 0;
      for (int j = 0; j < 8; ++j) {
        const std::uint8_t* w = u + kQ4KxCodes + 512 * (j / 2);
        std::int32_t s = 0;
        for (int c = 0; c < 8; ++c) {
          for (int k = 0; k < 4; ++k) {
            const std::uint8_t byte = w[64 * c + 4 * r + k];
            s += static_cast<std::int32_t>(j % 2 == 0 ? byte & 15 : byte >> 4) * q[32 * j + 4 * c + k];
          }
        }
        isum += s * u[kQ4KxScales + 16 * j + r];
        msum += u[kQ4KxMins + 16 * j + r] * BlockCodeSum(x, 8 * i + static_cast<std::size_t>(j));
      }
      const float dx = x.d[8 * i];
      acc += static_cast<float>(isum) * (Half(u + 2 * r) * dx) - static_cast<float>(msum) * (Half(u + kQ4KxMin + 2 * r) * dx);
    }
    out[r] = acc;
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Q6_Kx16: Q6_K matrices repacked at load (interleave, quant_gemv.h). A unit (super-block i of a
// 16-row group, 3360 bytes: Q6_K's 210 a row): the rows' fp16 d, their int8 scales as [group g of
// 16 values][row], then per half h (128 values) and c = 0..7 three 64-byte chunks X0, X1, X2, each
// [row 0..15][4 bytes]: byte k of a row's 4 in Xj holds in bits 0-5 the 6-bit code of value
// 128h + 32j + 4c + k (quarter j) and in bits 6-7 bits 2j, 2j+1 of the code of value
// 128h + 96 + 4c + k (quarter 3). Quarters 0-2 are one AND each; quarter 3 comes out as 4 x its
// code from two shifts, two bit selects and an AND (Q6_K's own ql / qh split, kept by the first
// Q6_Kx16, cost a shift, a mask and an or per code vector, and a second shift and mask for half of
// them). Codes 0..63 stand for code - 32. With the q8_k activation (one scale dx per 256 values) a
// row's super-block is dx * d * sum_g sc_g * (dot(q_g, x_g) - 32 * sum(x_g)), all in int32
// (|.| <= 16 x 16 x 32 x 128 x 128 < 2^27; a quarter-3 group's sum, 4x, before its shift < 2^22):
// one convert and one FMA per unit for 16 rows.
#if HWY_TARGET == HWY_AVX3_DL
HWY_INLINE __m512i Q6Low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x3f)); }
// 4 x the quarter-3 codes of the chunks x0, x1, x2. The 16-bit shifts move bits 6-7 of x1 to 4-5
// and of x0 to 2-3; what they pull down from a word's high byte lands in the low byte's bits 6-7
// and 4-7, which the selects take from x2 and x1; bits 0-1 (x0's 4-5) are masked off.
HWY_INLINE __m512i Q6Top4(__m512i x0, __m512i x1, __m512i x2) {
  // Bit by bit, c ? a : b (imm 0xe4) and c ? b : a (0xd8): the shifted temporaries are the operand
  // vpternlogd overwrites, so the mask constants need no copy.
  const __m512i s = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x1, 2), _mm512_srli_epi16(x0, 4), _mm512_set1_epi8(0x30), 0xe4);
  const __m512i v = _mm512_ternarylogic_epi32(s, x2, _mm512_set1_epi8(static_cast<char>(0xc0)), 0xd8);
  return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xfc)));
}

// isum + sc_g * p for the 16 rows (sc: the group's 16 int8 scales at s).
HWY_INLINE __m512i Q6Group(__m512i isum, __m512i p, const std::uint8_t* s) {
  const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  return _mm512_add_epi32(isum, _mm512_mullo_epi32(p, sc));
}

void GroupQ6_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  auto unit = [&](std::size_t i, __m512& acc) {
    // No software prefetch, as for Q4_0x16: the repacked matrices sit on 2 MiB pages.
    const std::uint8_t* u = g + kQ6Kx16Unit * i;
    const std::int8_t* q = x.q.data() + 256 * i;
    // The offset's -32 * sum(x_g) per group g (quarter 3's groups: 4x, as its codes), in lanes.
    const __m512i xs = _mm512_loadu_si512(x.s16.data() + 16 * i);
    const __m512i off32 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(xs, 5));
    const __m512i off128 = _mm512_slli_epi32(off32, 2);
    __m512i isum = _mm512_setzero_si512();
    // Per half h and e (chunks 4e..4e+3: values 16e..16e+15 of each quarter, one scale group per
    // quarter) four accumulators indexed only by unrolled loops, so they stay in registers; each
    // starts at its group's offset.
    for (int he = 0; he < 4; ++he) {
      const int h = he / 2, e = he % 2;
      const std::uint8_t* w = u + kQ6KxCodes + 1536 * h + 768 * e;
      const std::int8_t* qh = q + 128 * h + 16 * e;
      const int g0 = 8 * h + e;  // quarter t's group: g0 + 2t
      __m512i p[4] = {_mm512_permutexvar_epi32(_mm512_set1_epi32(g0), off32), _mm512_permutexvar_epi32(_mm512_set1_epi32(g0 + 2), off32),
                      _mm512_permutexvar_epi32(_mm512_set1_epi32(g0 + 4), off32), _mm512_permutexvar_epi32(_mm512_set1_epi32(g0 + 6), off128)};
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i x0 = _mm512_loadu_si512(w + 192 * c), x1 = _mm512_loadu_si512(w + 192 * c + 64),
                      x2 = _mm512_loadu_si512(w + 192 * c + 128);
        p[0] = DotBcast(p[0], Q6Low(x0), qh + 4 * c);
        p[1] = DotBcast(p[1], Q6Low(x1), qh + 32 + 4 * c);
        p[2] = DotBcast(p[2], Q6Low(x2), qh + 64 + 4 * c);
        p[3] = DotBcast(p[3], Q6Top4(x0, x1, x2), qh + 96 + 4 * c);
      }
      p[3] = _mm512_srai_epi32(p[3], 2);  // exact: 4 x (dot - 32 sum)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) isum = Q6Group(isum, p[t], u + kQ6KxScales + 16 * (g0 + 2 * t));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(x.d[8 * i])), acc);
  };
  SumUnitsTwoChains(n_super, out, unit);
}

// Prefill: per half and scale-group half, the 16 code vectors of 4 chunks unpacked once for NT tokens.
template <int NT>
void TileQ6_Kx16(const std::uint8_t* g, std::size_t n_super, const Q8Blocks* xs, std::size_t t0, float* y, std::size_t ldy,
                 std::size_t row0, __mmask16 m) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* u = g + kQ6Kx16Unit * i;
    __m512i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = zero;
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 2; ++e) {  // chunks c = 4e..4e+3: values 16e..16e+15 of each quarter
        const std::uint8_t* w = u + kQ6KxCodes + 1536 * h + 768 * e;
        __m512i v[4][4];  // [quarter][chunk]; quarter 3 as 4 x its codes
        for (int c = 0; c < 4; ++c) {
          const __m512i x0 = _mm512_loadu_si512(w + 192 * c), x1 = _mm512_loadu_si512(w + 192 * c + 64),
                        x2 = _mm512_loadu_si512(w + 192 * c + 128);
          v[0][c] = Q6Low(x0);
          v[1][c] = Q6Low(x1);
          v[2][c] = Q6Low(x2);
          v[3][c] = Q6Top4(x0, x1, x2);
        }
        for (int t = 0; t < NT; ++t) {
          const Q8Blocks& x = xs[t0 + t];
          for (int qt = 0; qt < 4; ++qt) {
            const std::int8_t* q = x.q.data() + 256 * i + 128 * h + 32 * qt + 16 * e;
            const int gi = 8 * h + 2 * qt + e;
            __m512i p = _mm512_set1_epi32((qt == 3 ? -128 : -32) * x.s16[16 * i + gi]);
            for (int c = 0; c < 4; ++c) p = DotBcast(p, v[qt][c], q + 4 * c);
            if (qt == 3) p = _mm512_srai_epi32(p, 2);
            isum[t] = Q6Group(isum[t], p, u + kQ6KxScales + 16 * gi);
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, _mm512_set1_ps(xs[t0 + t].d[8 * i])), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + row0, m, acc[t]);
}

#elif KVSLIM_QGEMV_X86
// AVX2 / AVX3: rows 0-7 and 8-15 of a chunk are its two 32-byte halves; vpmaddwd against each
// row's signed scale held in both int16 halves of its lane scales the vpmaddubsw pair sums (exact:
// |pair| <= 2 x 63 x 128, |scale| <= 128), and the offset 32 is taken off per group with one
// multiply of the scales by 32 * sum(x_g). Quarter 3's codes are taken whole (vpmaddubsw's int16
// pair sums would overflow at 4x).
HWY_INLINE __m256i SignedScalePairs8(const std::uint8_t* p) {
  const __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s, 16));
}

// The codes of quarter t from the chunks x0, x1, x2.
HWY_INLINE __m256i Q6Codes(int t, __m256i x0, __m256i x1, __m256i x2) {
  const __m256i m6 = _mm256_set1_epi8(0x3f);
  switch (t) {
    case 0: return _mm256_and_si256(x0, m6);
    case 1: return _mm256_and_si256(x1, m6);
    case 2: return _mm256_and_si256(x2, m6);
    default: {
      // 4 x code in bits 2-7 (nothing pulled across a byte by the 16-bit shifts survives the masks),
      // then down by 2: the low byte's bits 6-7 receive the high byte's bits 0-1, which are 0.
      const __m256i v = _mm256_or_si256(
          _mm256_and_si256(x2, _mm256_set1_epi8(static_cast<char>(0xc0))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x1, 2), _mm256_set1_epi8(0x30)),
                          _mm256_and_si256(_mm256_srli_epi16(x0, 4), _mm256_set1_epi8(0x0c))));
      return _mm256_srli_epi16(v, 2);
    }
  }
}

void GroupQ6_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (std::size_t i = 0; i < n_super; ++i) {
    const std::uint8_t* u = g + kQ6Kx16Unit * i;
    const std::int8_t* q = x.q.data() + 256 * i;
    __m256i is[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int h = 0; h < 2; ++h) {
      const std::uint8_t* w = u + kQ6KxCodes + 1536 * h;
      for (int c = 0; c < 8; ++c) {
        for (int k = 0; k < 2; ++k) {  // rows 8k..8k+7
          const __m256i x0 = Load32(w + 192 * c + 32 * k), x1 = Load32(w + 192 * c + 64 + 32 * k),
                        x2 = Load32(w + 192 * c + 128 + 32 * k);
          for (int t = 0; t < 4; ++t) {
            const int gi = 8 * h + 2 * t + c / 4;
            std::int32_t xv;
            std::memcpy(&xv, q + 128 * h + 32 * t + 4 * c, 4);
            const __m256i pairs = _mm256_maddubs_epi16(Q6Codes(t, x0, x1, x2), _mm256_set1_epi32(xv));
            is[k] = _mm256_add_epi32(is[k], _mm256_madd_epi16(pairs, SignedScalePairs8(u + kQ6KxScales + 16 * gi + 8 * k)));
          }
        }
      }
    }
    for (int gi = 0; gi < 16; ++gi) {
      const __m256i off = _mm256_set1_epi32(32 * x.s16[16 * i + gi]);
      for (int k = 0; k < 2; ++k) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + kQ6KxScales + 16 * gi + 8 * k)));
        is[k] = _mm256_sub_epi32(is[k], _mm256_mullo_epi32(sc, off));
      }
    }
    const __m256 dx = _mm256_set1_ps(x.d[8 * i]);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[0]), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))), dx), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[1]), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16))), dx), acc1);
  }
  _mm256_storeu_ps(out, acc0);
  _mm256_storeu_ps(out + 8, acc1);
}

#else
// Portable: the same integer sums, one code at a time.
void GroupQ6_Kx16(const std::uint8_t* g, const Q8Blocks& x, std::size_t n_super, float* out) {
  for (int r = 0; r < 16; ++r) {
    float acc = 0;
    for (std::size_t i = 0; i < n_super; ++i) {
      const std::uint8_t* u = g + kQ6Kx16Unit * i;
      const std::int8_t* q = x.q.data() + 256 * i;
      std::int32_t isum = 0;
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 4; ++t) {
          for (int e = 0; e < 2; ++e) {
            const int gi = 8 * h + 2 * t + e;
            std::int32_t s = 0;
            for (int c = 4 * e; c < 4 * e + 4; ++c) {
              const std::uint8_t* w = u + kQ6KxCodes + 1536 * h + 192 * c + 4 * r;
              for (int k = 0; k < 4; ++k) {
                const int code = t < 3 ? w[64 * t + k] & 63 : (w[k] >> 6) | ((w[64 + k] >> 6) << 2) | ((w[128 + k] >> 6) << 4);
                s += code * q[128 * h + 32 * t + 4 * c + k];
              }
            }
            isum += static_cast<std::int8_t>(u[kQ6KxScales + 16 * gi + r]) * (s - 32 * x.s16[16 * i + gi]);
          }
        }
      }
      acc += static_cast<float>(isum) * (Half(u + 2 * r) * x.d[8 * i]);
    }
    out[r] = acc;
  }
}
#endif

// y[r] for r in [r0, r1) of an interleaved matrix whose 16-row groups are `stride` bytes apart,
// group(g, out) writing the 16 values of the group at g: whole groups straight into y, a partial
// group through a 16-value buffer (each row's value does not depend on the range).
template <class Group>
void GemvGroups(const std::uint8_t* base, std::size_t stride, float* y, std::size_t r0, std::size_t r1, const Group& group) {
  for (std::size_t g = r0 / 16; 16 * g < r1; ++g) {
    const std::size_t lo = 16 * g;
    if (lo >= r0 && lo + 16 <= r1) {
      group(base + g * stride, y + lo);
    } else {
      alignas(64) float tmp[16];
      group(base + g * stride, tmp);
      for (std::size_t r = std::max(lo, r0); r < std::min(lo + 16, r1); ++r) y[r] = tmp[r - lo];
    }
  }
}

void GemvRows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks& x, float* y,
              std::size_t r0, std::size_t r1) {
  const auto* base = static_cast<const std::uint8_t*>(w);
  if (type == WeightType::q4_0x16) {
    const std::size_t nb = cols / 32;
    GemvGroups(base, kQ4x16Unit * nb, y, r0, r1, [&](const std::uint8_t* g, float* out) { GroupQ4_0x16(g, x, nb, out); });
    return;
  }
  if (type == WeightType::q4_kx16) {
    const std::size_t ns = cols / 256;
    GemvGroups(base, kQ4Kx16Unit * ns, y, r0, r1, [&](const std::uint8_t* g, float* out) { GroupQ4_Kx16(g, x, ns, out); });
    return;
  }
  if (type == WeightType::q6_kx16) {
    const std::size_t ns = cols / 256;
    GemvGroups(base, kQ6Kx16Unit * ns, y, r0, r1, [&](const std::uint8_t* g, float* out) { GroupQ6_Kx16(g, x, ns, out); });
    return;
  }
  for (std::size_t r = r0; r < r1; ++r) {
    const std::uint8_t* row = base + r * row_bytes;
    switch (type) {
#if HWY_TARGET == HWY_AVX3_DL
      case WeightType::q8_0: y[r] = DotQ8_0Wide(row, x, cols / 32); break;
      case WeightType::q4_0: y[r] = DotQ4_0Wide(row, x, cols / 32); break;
      case WeightType::q4_k: y[r] = DotQK_Wide<4>(row, x, cols / 256); break;
      case WeightType::q5_k: y[r] = DotQK_Wide<5>(row, x, cols / 256); break;
      case WeightType::q6_k: y[r] = DotQ6_KWide(row, x, cols / 256); break;
#else
      case WeightType::q8_0: y[r] = DotQ8_0(row, x, cols / 32); break;
      case WeightType::q4_0: y[r] = DotQ4_0(row, x, cols / 32); break;
      case WeightType::q4_k: y[r] = DotQK_MinMax<4>(row, x, cols / 256); break;
      case WeightType::q5_k: y[r] = DotQK_MinMax<5>(row, x, cols / 256); break;
      case WeightType::q6_k: y[r] = DotQ6_K(row, x, cols / 256); break;
#endif
      default: y[r] = 0; break;
    }
  }
}


// ---------------------------------------------------------------------------------------------
// Prefill: Y[t, r] for several tokens. AVX3_DL repacks 16 weight rows at a time into unsigned
// byte codes laid out [unit of 16 values][4-byte chunk][row][4 bytes] with an fp32 scale and offset
// per (unit, row) (value = scale * code - offset), so one vpdpbusd with the token's 4 activation
// bytes broadcast advances 16 rows at once; every (unit, token) then costs one convert and two FMAs
// for 16 rows. Other targets run the gemv kernel once per token.

#if HWY_TARGET == HWY_AVX3_DL
// Row `row` of `type` as unsigned codes [cols] and per-16 scale / offset [cols / 16].
void DecodeCodes(WeightType type, const std::uint8_t* row, std::size_t cols, std::uint8_t* codes, float* sc, float* off) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30), bit4 = _mm256_set1_epi8(0x10);
  auto store = [&](std::size_t e, __m256i c, float s0, float o0, float s1, float o1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + e), c);
    sc[e / 16] = s0;
    off[e / 16] = o0;
    sc[e / 16 + 1] = s1;
    off[e / 16 + 1] = o1;
  };
  switch (type) {
    case WeightType::q8_0:
      for (std::size_t b = 0; b < cols / 32; ++b) {
        const float d = Half(row + 34 * b);
        store(32 * b, _mm256_xor_si256(Load32(row + 34 * b + 2), _mm256_set1_epi8(static_cast<char>(0x80))), d, 128 * d, d, 128 * d);
      }
      return;
    case WeightType::q4_0:
      for (std::size_t b = 0; b < cols / 32; ++b) {
        const float d = Half(row + 18 * b);
        store(32 * b, Q4_0Codes(row + 18 * b + 2), d, 8 * d, d, 8 * d);
      }
      return;
    case WeightType::q4_k:
    case WeightType::q5_k: {
      const bool five = type == WeightType::q5_k;
      const std::size_t bb = five ? 176 : 144;
      for (std::size_t i = 0; i < cols / 256; ++i) {
        const std::uint8_t* blk = row + bb * i;
        const float d = Half(blk), dmin = Half(blk + 2);
        const std::uint8_t* qs = blk + 16 + (five ? 32 : 0);
        const __m256i qh = five ? Load32(blk + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          int sc0, m0, sc1, m1;
          ScaleMinK4(blk + 4, 2 * j, sc0, m0);
          ScaleMinK4(blk + 4, 2 * j + 1, sc1, m1);
          const __m256i q = Load32(qs + 32 * j);
          __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if (five) {
            const __m256i mlo = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
            const __m256i mhi = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mlo), mlo), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mhi), mhi), bit4));
          }
          const float s0 = d * static_cast<float>(sc0), o0 = dmin * static_cast<float>(m0);
          const float s1 = d * static_cast<float>(sc1), o1 = dmin * static_cast<float>(m1);
          store(256 * i + 64 * j, lo, s0, o0, s0, o0);
          store(256 * i + 64 * j + 32, hi, s1, o1, s1, o1);
        }
      }
      return;
    }
    case WeightType::q6_k:
      for (std::size_t i = 0; i < cols / 256; ++i) {
        const std::uint8_t* blk = row + 210 * i;
        const float d = Half(blk + 208);
        const auto* scl = reinterpret_cast<const std::int8_t*>(blk + 192);
        for (int h = 0; h < 2; ++h) {
          const __m256i l0 = Load32(blk + 64 * h), l1 = Load32(blk + 64 * h + 32), qh = Load32(blk + 128 + 32 * h);
          const __m256i u[4] = {
              _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
              _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)),
          };
          for (int k = 0; k < 4; ++k) {
            const float s0 = d * static_cast<float>(scl[8 * h + 2 * k]), s1 = d * static_cast<float>(scl[8 * h + 2 * k + 1]);
            store(256 * i + 128 * h + 32 * k, u[k], s0, 32 * s0, s1, 32 * s1);
          }
        }
      }
      return;
    default: return;
  }
}

// Formats whose two 16-value halves of a 32-value block share the scale and offset (all but
// Q6_K): one int32 sum per (block, token), then one convert and two FMAs for 16 rows.
template <int NT>
void TileTokens32(const std::uint8_t* tc, const float* ts, const float* to, std::size_t units, const Q8Blocks* xs,
                  std::size_t t0, float* y, std::size_t ldy, std::size_t r0, std::size_t nr) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (std::size_t b = 0; b < units / 2; ++b) {
    const std::uint8_t* w = tc + b * 512;
    __m512i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(w + 64 * c);
    const __m512 sv = _mm512_loadu_ps(ts + 32 * b), ov = _mm512_loadu_ps(to + 32 * b);
    for (int t = 0; t < NT; ++t) {
      const Q8Blocks& x = xs[t0 + t];
      const std::int8_t* xq = x.q.data() + 32 * b;
      __m512i p = DotBcast(zero, wv[0], xq);
      for (int c = 1; c < 8; ++c) p = DotBcast(p, wv[c], xq + 4 * c);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv, _mm512_set1_ps(x.d[b])), acc[t]);
      acc[t] = _mm512_fnmadd_ps(ov, _mm512_set1_ps(x.ds[b]), acc[t]);
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << nr) - 1u);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + r0, m, acc[t]);
}

template <int NT>
void TileTokens(const std::uint8_t* tc, const float* ts, const float* to, std::size_t units, const Q8Blocks* xs,
                std::size_t t0, float* y, std::size_t ldy, std::size_t r0, std::size_t nr) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (std::size_t u = 0; u < units; ++u) {
    const std::uint8_t* w = tc + u * 256;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128),
                  w3 = _mm512_loadu_si512(w + 192);
    const __m512 sv = _mm512_loadu_ps(ts + 16 * u), ov = _mm512_loadu_ps(to + 16 * u);
    for (int t = 0; t < NT; ++t) {
      const Q8Blocks& x = xs[t0 + t];
      const std::int8_t* xq = x.q.data() + 16 * u;
      __m512i p = DotBcast(zero, w0, xq);
      p = DotBcast(p, w1, xq + 4);
      p = DotBcast(p, w2, xq + 8);
      p = DotBcast(p, w3, xq + 12);
      const float dx = x.d[u / 2];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv, _mm512_set1_ps(dx)), acc[t]);
      acc[t] = _mm512_fnmadd_ps(ov, _mm512_set1_ps(dx * static_cast<float>(x.s16[u])), acc[t]);
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << nr) - 1u);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + r0, m, acc[t]);
}
#endif

void GemmRows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks* xs, std::size_t n,
              float* y, std::size_t ldy, std::size_t r0, std::size_t r1) {
#if HWY_TARGET == HWY_AVX3_DL
  if (weight_interleave_rows(type) > 1) {  // the repacked groups are read as they are (no tile to build)
    const auto* base = static_cast<const std::uint8_t*>(w);
    const std::size_t units = cols / weight_block_elements(type), stride = 16 * weight_type_size(type) * units;
    // The tile of NT tokens from t over group grp, rows of mask m (the group's rows in [r0, r1)).
    auto tile = [&]<int NT>(const std::uint8_t* grp, std::size_t t, std::size_t lo, __mmask16 m) {
      switch (type) {
        case WeightType::q4_kx16: TileQ4_Kx16<NT>(grp, units, xs, t, y, ldy, lo, m); break;
        case WeightType::q6_kx16: TileQ6_Kx16<NT>(grp, units, xs, t, y, ldy, lo, m); break;
        default: TileQ4_0x16<NT>(grp, units, xs, t, y, ldy, lo, m); break;
      }
    };
    for (std::size_t g = r0 / 16; 16 * g < r1; ++g) {
      const std::size_t lo = 16 * g, a = std::max(lo, r0) - lo, e = std::min(lo + 16, r1) - lo;
      const auto m = static_cast<__mmask16>(((1u << e) - 1u) & ~((1u << a) - 1u));
      const std::uint8_t* grp = base + g * stride;
      std::size_t t = 0;
      for (; t + 4 <= n; t += 4) tile.template operator()<4>(grp, t, lo, m);
      switch (n - t) {
        case 3: tile.template operator()<3>(grp, t, lo, m); break;
        case 2: tile.template operator()<2>(grp, t, lo, m); break;
        case 1: tile.template operator()<1>(grp, t, lo, m); break;
        default: break;
      }
    }
    return;
  }
  const std::size_t units = cols / 16;
  thread_local std::vector<std::uint8_t> row_codes, tile_codes;
  thread_local std::vector<float> row_s, row_o, tile_s, tile_o;
  if (row_codes.size() < cols + 64) row_codes.resize(cols + 64);
  if (row_s.size() < units) {
    row_s.resize(units);
    row_o.resize(units);
  }
  if (tile_codes.size() < 16 * cols) tile_codes.resize(16 * cols);
  if (tile_s.size() < 16 * units) {
    tile_s.resize(16 * units);
    tile_o.resize(16 * units);
  }
  const auto* base = static_cast<const std::uint8_t*>(w);
  for (std::size_t rt = r0; rt < r1; rt += 16) {
    const std::size_t nr = std::min<std::size_t>(16, r1 - rt);
    for (std::size_t r = 0; r < 16; ++r) {
      if (r < nr) {
        DecodeCodes(type, base + (rt + r) * row_bytes, cols, row_codes.data(), row_s.data(), row_o.data());
      } else {
        std::memset(row_codes.data(), 0, cols);
        std::fill_n(row_s.data(), units, 0.0f);
        std::fill_n(row_o.data(), units, 0.0f);
      }
      for (std::size_t u = 0; u < units; ++u) {
        for (int c = 0; c < 4; ++c) std::memcpy(tile_codes.data() + ((u * 4 + c) * 16 + r) * 4, row_codes.data() + 16 * u + 4 * c, 4);
        tile_s[u * 16 + r] = row_s[u];
        tile_o[u * 16 + r] = row_o[u];
      }
    }
    const std::uint8_t* tc = tile_codes.data();
    const float *ts = tile_s.data(), *to = tile_o.data();
    std::size_t t = 0;
    if (type == WeightType::q6_k) {
      for (; t + 4 <= n; t += 4) TileTokens<4>(tc, ts, to, units, xs, t, y, ldy, rt, nr);
      switch (n - t) {
        case 3: TileTokens<3>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        case 2: TileTokens<2>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        case 1: TileTokens<1>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        default: break;
      }
    } else {
      for (; t + 4 <= n; t += 4) TileTokens32<4>(tc, ts, to, units, xs, t, y, ldy, rt, nr);
      switch (n - t) {
        case 3: TileTokens32<3>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        case 2: TileTokens32<2>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        case 1: TileTokens32<1>(tc, ts, to, units, xs, t, y, ldy, rt, nr); break;
        default: break;
      }
    }
  }
#else
  thread_local std::vector<float> col;
  if (col.size() < r1) col.resize(r1);
  for (std::size_t t = 0; t < n; ++t) {
    GemvRows(type, w, row_bytes, cols, xs[t], col.data(), r0, r1);
    std::copy(col.data() + r0, col.data() + r1, y + t * ldy + r0);
  }
#endif
}

bool GemmIsPacked() { return HWY_TARGET == HWY_AVX3_DL; }

// ---------------------------------------------------------------------------------------------
// Dequantization (prefill tiles, embedding rows).

#if KVSLIM_QGEMV_X86
// out[0..32) = float(codes[i] (signed bytes) + bias) * scale - offset, bias applied in int.
HWY_INLINE void Store32(__m256i codes, int bias, float scale, float offset, float* out) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  const __m256i bv = _mm256_set1_epi32(bias);
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_add_epi32(_mm256_cvtepi8_epi32(parts[k]), bv);
    _mm256_storeu_ps(out + 8 * k, _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), s), o));
  }
}

void Dequantize(WeightType type, const void* src, float* dst, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(src);
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30), bit4 = _mm256_set1_epi8(0x10);
  switch (type) {
    case WeightType::q8_0:
      for (std::size_t b = 0; b < n / 32; ++b) Store32(Load32(p + 34 * b + 2), 0, Half(p + 34 * b), 0.0f, dst + 32 * b);
      return;
    case WeightType::q4_0:
      for (std::size_t b = 0; b < n / 32; ++b) Store32(Q4_0Codes(p + 18 * b + 2), -8, Half(p + 18 * b), 0.0f, dst + 32 * b);
      return;
    case WeightType::q4_k:
    case WeightType::q5_k: {
      const bool five = type == WeightType::q5_k;
      const std::size_t bb = five ? 176 : 144;
      for (std::size_t i = 0; i < n / 256; ++i) {
        const std::uint8_t* blk = p + bb * i;
        const float d = Half(blk), dmin = Half(blk + 2);
        const std::uint8_t* qs = blk + 16 + (five ? 32 : 0);
        const __m256i qh = five ? Load32(blk + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          int sc0, m0, sc1, m1;
          ScaleMinK4(blk + 4, 2 * j, sc0, m0);
          ScaleMinK4(blk + 4, 2 * j + 1, sc1, m1);
          const __m256i q = Load32(qs + 32 * j);
          __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if (five) {
            const __m256i mlo = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
            const __m256i mhi = _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1)));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mlo), mlo), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mhi), mhi), bit4));
          }
          float* out = dst + 256 * i + 64 * j;
          Store32(lo, 0, d * static_cast<float>(sc0), dmin * static_cast<float>(m0), out);
          Store32(hi, 0, d * static_cast<float>(sc1), dmin * static_cast<float>(m1), out + 32);
        }
      }
      return;
    }
    case WeightType::q6_k:
      for (std::size_t i = 0; i < n / 256; ++i) {
        const std::uint8_t* blk = p + 210 * i;
        const float d = Half(blk + 208);
        const auto* sc = reinterpret_cast<const std::int8_t*>(blk + 192);
        for (int h = 0; h < 2; ++h) {
          const __m256i l0 = Load32(blk + 64 * h), l1 = Load32(blk + 64 * h + 32), qh = Load32(blk + 128 + 32 * h);
          const __m256i u[4] = {
              _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
              _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)),
          };
          for (int k = 0; k < 4; ++k) {
            alignas(32) float tmp[32];
            // Two scale groups of 16: decode with scale 1, then scale each half.
            Store32(u[k], -32, 1.0f, 0.0f, tmp);
            float* out = dst + 256 * i + 128 * h + 32 * k;
            const float s0 = d * static_cast<float>(sc[8 * h + 2 * k]), s1 = d * static_cast<float>(sc[8 * h + 2 * k + 1]);
            for (int l = 0; l < 16; ++l) out[l] = s0 * tmp[l];
            for (int l = 16; l < 32; ++l) out[l] = s1 * tmp[l];
          }
        }
      }
      return;
    default: return;
  }
}
#else
void Dequantize(WeightType type, const void* src, float* dst, std::size_t n) {
  gguf::TensorType t = gguf::TensorType::q8_0;
  switch (type) {
    case WeightType::q8_0: t = gguf::TensorType::q8_0; break;
    case WeightType::q4_0: t = gguf::TensorType::q4_0; break;
    case WeightType::q4_k: t = gguf::TensorType::q4_k; break;
    case WeightType::q5_k: t = gguf::TensorType::q5_k; break;
    case WeightType::q6_k: t = gguf::TensorType::q6_k; break;
    default: return;
  }
  gguf::to_float(static_cast<const std::byte*>(src), t, dst, n);
}
#endif

// ---------------------------------------------------------------------------------------------
// Activation quantization (quantize_activation), the same arithmetic on every target: codes
// round(x * id) (ties to even, as lrintf), clamped to 127; int32 sums per 16 codes.

namespace hn = hwy::HWY_NAMESPACE;

// The codes of `count` values (a multiple of 16) at x, scaled by id; returns their sum, writes the
// per-16 sums to s16.
HWY_INLINE std::int32_t QuantizeCodes(const float* x, std::size_t count, float id, std::int8_t* q, std::int32_t* s16) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<std::int8_t, decltype(di)> d8;
  const std::size_t N = hn::Lanes(df);
  const auto vid = hn::Set(df, id);
  const auto lim = hn::Set(di, 127);
  std::int32_t total = 0;
  for (std::size_t g = 0; g < count; g += 16) {
    auto sum = hn::Zero(di);
    std::size_t j = 0;
    for (; j + N <= 16; j += N) {
      const auto c = hn::Min(hn::NearestInt(hn::Mul(hn::LoadU(df, x + g + j), vid)), lim);
      sum = hn::Add(sum, c);
      hn::StoreU(hn::DemoteTo(d8, c), d8, q + g + j);
    }
    std::int32_t s = hn::GetLane(hn::SumOfLanes(di, sum));
    for (; j < 16; ++j) {  // lanes > 16 (none of today's targets)
      const std::int32_t c = static_cast<std::int32_t>(std::min(127L, std::lrintf(x[g + j] * id)));
      q[g + j] = static_cast<std::int8_t>(c);
      s += c;
    }
    s16[g / 16] = s;
    total += s;
  }
  return total;
}

// max |x| over n values, and (want_signed) the first value that has it.
HWY_INLINE float AbsMax(const float* x, std::size_t n, bool want_signed, float& signed_max) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  float amax = 0;
  std::size_t j = 0;
  if (n >= N) {
    auto m = hn::Zero(df);
    for (; j + N <= n; j += N) m = hn::Max(m, hn::Abs(hn::LoadU(df, x + j)));
    amax = hn::GetLane(hn::MaxOfLanes(df, m));
  }
  for (; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  signed_max = 0;
  for (std::size_t k = 0; want_signed && k < n; ++k) {
    if (std::fabs(x[k]) == amax) {
      signed_max = x[k];
      break;
    }
  }
  return amax;
}

void QuantizeActivation(const float* x, std::size_t n, int format, std::int8_t* q, float* d, float* ds, std::int32_t* s16) {
  const auto fmt = static_cast<ActivationFormat>(format);
  const std::size_t group = fmt == ActivationFormat::q8_k ? 256 : 32;
  for (std::size_t g = 0; g < n / group; ++g) {
    const float* v = x + group * g;
    float max = 0;
    const float amax = AbsMax(v, group, fmt == ActivationFormat::q8_k, max);
    float dd = 0, id = 0;
    switch (fmt) {
      case ActivationFormat::fine: dd = amax / 127.0f, id = dd != 0 ? 1.0f / dd : 0.0f; break;
      case ActivationFormat::q8_0:  // ggml's x86 quantize_row_q8_0: codes from 127 / amax, d stored as fp16
        id = amax != 0 ? 127.0f / amax : 0.0f;
        dd = fp16_to_f32(f32_to_fp16(amax / 127.0f));
        break;
      case ActivationFormat::q8_k:  // ggml's quantize_row_q8_K_ref: iscale = -127 / max, d = 1 / iscale
        if (amax != 0) {
          id = -127.0f / max;
          dd = 1.0f / id;
        }
        break;
    }
    for (std::size_t b = group * g / 32; b < group * (g + 1) / 32; ++b) {
      const std::int32_t sum = QuantizeCodes(x + 32 * b, 32, id, q + 32 * b, s16 + 2 * b);
      d[b] = dd;
      ds[b] = dd * static_cast<float>(sum);
    }
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kvslim::engine::qgemv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvslim::engine::qgemv {

HWY_EXPORT(GemvRows);
HWY_EXPORT(Dequantize);
HWY_EXPORT(TargetName);
HWY_EXPORT(GemmRows);
HWY_EXPORT(GemmIsPacked);
HWY_EXPORT(QuantizeActivation);

ActivationFormat activation_format(WeightType type) {
  return type == WeightType::q4_k || type == WeightType::q5_k || type == WeightType::q6_k || type == WeightType::q4_kx16 ||
                 type == WeightType::q6_kx16
             ? ActivationFormat::q8_k
             : ActivationFormat::q8_0;
}

void quantize_activation(const float* x, std::size_t n, Q8Blocks& out, ActivationFormat format) {
  out.n = n;
  out.format = format;
  if (out.q.size() < n) out.q.resize(n);
  if (out.d.size() < n / 32) {
    out.d.resize(n / 32);
    out.ds.resize(n / 32);
  }
  if (out.s16.size() < n / 16) out.s16.resize(n / 16);
  HWY_DYNAMIC_DISPATCH(QuantizeActivation)(x, n, static_cast<int>(format), out.q.data(), out.d.data(), out.ds.data(),
                                           out.s16.data());
  // The nibble orders of the wide Q4_0 / Q4_K kernels (quant_gemv.h).
  const std::size_t quads = n / 128;
  if (out.q_nib0.size() < quads * 128) out.q_nib0.resize(quads * 128);
  for (std::size_t g = 0; g < quads; ++g) {
    const std::int8_t* a = out.q.data() + 128 * g;
    std::int8_t* o = out.q_nib0.data() + 128 * g;
    for (int k = 0; k < 4; ++k) {
      std::memcpy(o + 16 * k, a + 32 * k, 16);
      std::memcpy(o + 64 + 16 * k, a + 32 * k + 16, 16);
    }
  }
  const std::size_t supers = n / 256;
  if (out.q_nibk.size() < supers * 256) out.q_nibk.resize(supers * 256);
  static constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (std::size_t i = 0; i < supers; ++i) {
    for (int k = 0; k < 8; ++k) std::memcpy(out.q_nibk.data() + 256 * i + 32 * k, out.q.data() + 256 * i + 32 * kOrder[k], 32);
  }
}

void quantize_activation_reference(const float* x, std::size_t n, Q8Blocks& out, ActivationFormat format) {
  out.n = n;
  out.format = format;
  out.q.assign(n, 0);
  out.d.assign(n / 32, 0.0f);
  out.ds.assign(n / 32, 0.0f);
  out.s16.assign(n / 16, 0);
  const std::size_t group = format == ActivationFormat::q8_k ? 256 : 32;
  for (std::size_t g = 0; g < n / group; ++g) {
    const float* v = x + group * g;
    float amax = 0, max = 0;  // the largest magnitude, and the value that has it
    for (std::size_t j = 0; j < group; ++j) {
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    float d = 0, id = 0;
    switch (format) {
      case ActivationFormat::fine: d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f; break;
      case ActivationFormat::q8_0:
        id = amax != 0 ? 127.0f / amax : 0.0f;
        d = fp16_to_f32(f32_to_fp16(amax / 127.0f));
        break;
      case ActivationFormat::q8_k:
        if (amax != 0) {
          id = -127.0f / max;
          d = 1.0f / id;
        }
        break;
    }
    for (std::size_t b = group * g / 32; b < group * (g + 1) / 32; ++b) {
      std::int8_t* q = out.q.data() + 32 * b;
      std::int32_t s0 = 0, s1 = 0;
      for (int j = 0; j < 32; ++j) {
        q[j] = static_cast<std::int8_t>(std::min(127L, std::lrintf(x[32 * b + j] * id)));
        (j < 16 ? s0 : s1) += q[j];
      }
      out.d[b] = d;
      out.ds[b] = d * static_cast<float>(s0 + s1);
      out.s16[2 * b] = s0;
      out.s16[2 * b + 1] = s1;
    }
  }
}

namespace {

void require_q8_k(WeightType type, const Q8Blocks& x, const char* fn) {
  if ((type == WeightType::q4_kx16 || type == WeightType::q6_kx16) && x.format != ActivationFormat::q8_k) {
    throw std::invalid_argument(std::string(fn) + ": " + weight_type_name(type) +
                                " needs the activation quantized as q8_k (one scale per 256 values; activation_format)");
  }
}

// The file type an interleaved type was repacked from (the type itself for the others).
WeightType base_type(WeightType type) {
  switch (type) {
    case WeightType::q4_0x16: return WeightType::q4_0;
    case WeightType::q4_kx16: return WeightType::q4_k;
    case WeightType::q6_kx16: return WeightType::q6_k;
    default: return type;
  }
}

// Moves row r (0..15) of a 16-row group between the file's blocks (`blocks`, `units` blocks or
// super-blocks of the base type) and its slots in the group `grp`: into the group when `to_group`,
// back into blocks otherwise. interleave and deinterleave_row both go through here, so each layout
// (quant_gemv.h) is written once.
void transfer_row(WeightType base, std::uint8_t* grp, std::uint8_t* blocks, std::size_t units, std::size_t r, bool to_group) {
  auto move = [&](std::uint8_t* in_group, std::uint8_t* in_blocks, std::size_t n) {
    if (to_group) {
      std::memcpy(in_group, in_blocks, n);
    } else {
      std::memcpy(in_blocks, in_group, n);
    }
  };
  if (base == WeightType::q4_0) {
    for (std::size_t b = 0; b < units; ++b) {
      std::uint8_t* u = grp + kQ4x16Unit * b;
      std::uint8_t* blk = blocks + 18 * b;
      move(u + 2 * r, blk, 2);
      for (int c = 0; c < 4; ++c) move(u + 32 + 64 * c + 4 * r, blk + 2 + 4 * c, 4);
    }
    return;
  }
  if (base == WeightType::q6_k) {
    for (std::size_t i = 0; i < units; ++i) {
      std::uint8_t* u = grp + kQ6Kx16Unit * i;
      std::uint8_t* blk = blocks + 210 * i;
      move(u + 2 * r, blk + 208, 2);  // d
      for (int g = 0; g < 16; ++g) move(u + kQ6KxScales + 16 * g + r, blk + 192 + g, 1);
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; ++l) {  // values 128h + 32t + l, t = 0..3 (quarter t)
          // Q6_K: ql[64h + l] low nibbles quarter 0, high 2; ql[64h + 32 + l] quarters 1 and 3;
          // qh[32h + l] bits 2t, 2t+1 the high bits of quarter t.
          std::uint8_t& a = blk[64 * h + l];
          std::uint8_t& b = blk[64 * h + 32 + l];
          std::uint8_t& hb = blk[128 + 32 * h + l];
          std::uint8_t* x = u + kQ6KxCodes + 1536 * h + 192 * (l / 4) + 4 * r + l % 4;  // X0; X1, X2 at +64, +128
          if (to_group) {
            const int code[4] = {(a & 15) | ((hb & 3) << 4), (b & 15) | (((hb >> 2) & 3) << 4), (a >> 4) | (((hb >> 4) & 3) << 4),
                                 (b >> 4) | ((hb >> 6) << 4)};
            for (int j = 0; j < 3; ++j) x[64 * j] = static_cast<std::uint8_t>(code[j] | (((code[3] >> (2 * j)) & 3) << 6));
          } else {
            int code[4];
            for (int j = 0; j < 3; ++j) code[j] = x[64 * j] & 63;
            code[3] = (x[0] >> 6) | ((x[64] >> 6) << 2) | ((x[128] >> 6) << 4);
            a = static_cast<std::uint8_t>((code[0] & 15) | ((code[2] & 15) << 4));
            b = static_cast<std::uint8_t>((code[1] & 15) | ((code[3] & 15) << 4));
            hb = static_cast<std::uint8_t>((code[0] >> 4) | ((code[1] >> 4) << 2) | ((code[2] >> 4) << 4) | ((code[3] >> 4) << 6));
          }
        }
      }
    }
    return;
  }
  for (std::size_t i = 0; i < units; ++i) {  // Q4_K
    std::uint8_t* u = grp + kQ4Kx16Unit * i;
    std::uint8_t* blk = blocks + 144 * i;
    move(u + 2 * r, blk, 2);                  // d
    move(u + kQ4KxMin + 2 * r, blk + 2, 2);   // dmin
    for (int p = 0; p < 4; ++p) {
      for (int c = 0; c < 8; ++c) move(u + kQ4KxCodes + 512 * p + 64 * c + 4 * r, blk + 16 + 32 * p + 4 * c, 4);
    }
    auto* packed = reinterpret_cast<std::byte*>(blk + 4);
    if (!to_group) std::memset(packed, 0, 12);
    for (int j = 0; j < 8; ++j) {
      std::uint8_t* sc = u + kQ4KxScales + 16 * j + r;
      std::uint8_t* mn = u + kQ4KxMins + 16 * j + r;
      if (to_group) {
        int scale = 0, min = 0;
        gguf::k_scale_min(packed, j, scale, min);
        *sc = static_cast<std::uint8_t>(scale);
        *mn = static_cast<std::uint8_t>(min);
      } else {
        gguf::k_set_scale_min(packed, j, *sc, *mn);
      }
    }
  }
}

}  // namespace

void gemv_rows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks& x, float* y,
               std::size_t r0, std::size_t r1) {
  require_q8_k(type, x, "gemv_rows");
  HWY_DYNAMIC_DISPATCH(GemvRows)(type, w, row_bytes, cols, x, y, r0, r1);
}

void dequantize(WeightType type, const void* src, float* dst, std::size_t n) {
  if (weight_interleave_rows(type) > 1) {
    throw std::invalid_argument(std::string("dequantize: ") + weight_type_name(type) +
                                " interleaves rows: decode it with dequantize_rows");
  }
  HWY_DYNAMIC_DISPATCH(Dequantize)(type, src, dst, n);
}

void dequantize_rows(WeightType type, const void* w, std::size_t cols, std::size_t r0, std::size_t nr, float* dst) {
  if (weight_interleave_rows(type) > 1) {
    // Each row back in its file blocks, then the base type's decoder: the values its rows had.
    const WeightType base = base_type(type);
    thread_local std::vector<std::uint8_t> row;
    row.resize(weight_bytes(base, cols));
    for (std::size_t i = 0; i < nr; ++i) {
      deinterleave_row(type, w, cols, r0 + i, row.data());
      dequantize(base, row.data(), dst + i * cols, cols);
    }
    return;
  }
  dequantize(type, static_cast<const std::uint8_t*>(w) + r0 * weight_bytes(type, cols), dst, nr * cols);
}

WeightType interleaved_type(WeightType type) {
  switch (type) {
    case WeightType::q4_0: return WeightType::q4_0x16;
    case WeightType::q4_k: return WeightType::q4_kx16;
    case WeightType::q6_k: return WeightType::q6_kx16;
    default: return type;
  }
}

void interleave(WeightType type, const std::uint8_t* const* rows, std::size_t n_rows, std::size_t cols, std::uint8_t* out) {
  const WeightType to = interleaved_type(type);
  if (to == type) throw std::invalid_argument(std::string("interleave: ") + weight_type_name(type) + " has no interleaved form");
  const std::size_t block = weight_block_elements(type);
  if (n_rows % 16 != 0 || cols % block != 0) {
    throw std::invalid_argument(std::string("interleave: ") + weight_type_name(type) + " " + std::to_string(n_rows) + " x " +
                                std::to_string(cols) + " is not whole 16-row groups of " + std::to_string(block) +
                                "-value blocks");
  }
  const std::size_t stride = 16 * weight_bytes(to, cols);
  for (std::size_t g = 0; g < n_rows / 16; ++g) {
    for (std::size_t r = 0; r < 16; ++r) {
      // transfer_row only reads the row when moving it into the group.
      transfer_row(type, out + g * stride, const_cast<std::uint8_t*>(rows[16 * g + r]), cols / block, r, true);
    }
  }
}

void deinterleave_row(WeightType type, const void* w, std::size_t cols, std::size_t r, std::uint8_t* out) {
  if (weight_interleave_rows(type) == 1) {
    throw std::invalid_argument(std::string("deinterleave_row: ") + weight_type_name(type) + " is not interleaved");
  }
  const std::size_t stride = 16 * weight_bytes(type, cols);
  // transfer_row only reads the group when moving a row out of it.
  auto* grp = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(w)) + (r / 16) * stride;
  transfer_row(base_type(type), grp, out, cols / weight_block_elements(type), r % 16, false);
}

const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void gemm_rows(WeightType type, const void* w, std::size_t row_bytes, std::size_t cols, const Q8Blocks* xs, std::size_t n,
               float* y, std::size_t ldy, std::size_t r0, std::size_t r1) {
  for (std::size_t t = 0; t < n; ++t) require_q8_k(type, xs[t], "gemm_rows");
  HWY_DYNAMIC_DISPATCH(GemmRows)(type, w, row_bytes, cols, xs, n, y, ldy, r0, r1);
}

bool gemm_is_packed() { return HWY_DYNAMIC_DISPATCH(GemmIsPacked)(); }

}  // namespace kvslim::engine::qgemv
#endif  // HWY_ONCE
