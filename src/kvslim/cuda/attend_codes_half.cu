// Split-K decode attention over kivi codes on the tensor cores: the decode step's kernel (up to 4
// query vectors per KV head -- Llama's 32/8 heads, one token). The int8 kernel (attend_codes.cu)
// re-rounds q' and P into three s8 digits per 32-row unit and passes the digits through shared
// memory, ~900 instructions a unit and warp at D = 128, so it is bound by issue, not bytes. Here:
//
//   keys:   q . k = sum_c (q_c scale_c) code_c + q . zero per group, on the int8 tensor cores with
//           the codes where they lie (InPlaceKeyMap, fragment_maps.h): a key register is one LOP3
//           of a packed word (4 codes, each code * 2^(bits * plane)); q' / max|q'| becomes four s8
//           digits a channel once a group, scaled per plane so that every product carries the same
//           power of 2; digits 3, 2 of vector v are columns 2v, 2v + 1 of one mma, digits 1, 0 of a
//           second, and lane (g, t) holds vector t's four partial sums:
//           score = ((d3 * 256 + d2) * 256 + d1) * 256 + d0, times max|q'| 2^-kTotalBits, + q . zero.
//   values: sum_t p_t v_tc = scale_c sum_t p_t code_tc + zero_c sum_t p_t on the int8 tensor cores
//           too: the codes in place as u8 A (rows = channels, k = tokens: a register holds one
//           channel of 4 tokens, gathered by byte (PRMT) and masked by one LOP3 for 4 codes,
//           HalfCodeMap), P / the unit's largest P as two balanced s8 digits in columns 2v, 2v + 1
//           of B; a row's two s32 sums become one float once a unit (times the unit's scale), and the
//           group's sums take scale (over the plane's power of two) and zero once, at its last unit.
//           (The fp16 product before it -- a LOP3 and an HMUL2 for every two codes, P's hi and lo
//           fp16 parts -- took 960 warp instructions a K2V2 loop trip, every branch counted, where
//           this one takes 889, and kivi2 at 8 x 32k ran 5-7 % faster on an H100: docs/cuda.md,
//           "Stop 65" and "Stop 66".)
//
// Both products are exact on the codes; q' keeps 2^-22 of its largest element or better, and P 2^-16
// of the unit's largest P of its vector (the rounding of its two digits): up to ~1e-3 of an output
// element on outlier-laden values, inside the CPU kernels' 4e-3 but not the other device kernels'
// 2e-4 (bench/cuda/p_digits_error.py; tests/cuda/cuda_cache_test.cc, kDigitsOutTolerance). The codes
// and the zero points weigh the rows by their rounded P' alike; the softmax's sum is P's own. The
// softmax's reference moves only when a score passes it by more than kLeanSlack (P stays below
// 2^kLeanSlack), so the sums are rarely rescaled; every unit takes its vector's largest score (3
// shuffles), the digits' scale; each lane sums its own rows' P. (Stop 50 measured the lean
// reference against a max and a sum over the lanes every unit: docs/cuda.md, "Stop 50".)
//
// A CTA of 4 warps takes a range of units of one (b, h) (whole groups of group_units, or any units
// where groups vary: PackedRows::unit_starts); each warp takes a contiguous quarter of its units and
// streams them global -> shared (cp.async, kHalfStages stages; a group's parameters with its first
// unit the warp loads, into the slot of the group's ordinal modulo the stages). Lane
// (g, t) keeps vector t's online softmax and D/8 of its output channels (value_channel(i, g)). The
// warps merge in shared memory and the CTA writes one partial (attend_shared.cuh); launch_combine
// merges the splits.
#include <atomic>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "cuda/attend.h"
#include "cuda/attend_codes_half.h"
#include "cuda/attend_shared.cuh"
#include "cuda/fragment_maps.h"

namespace kvslim::cuda {
namespace {

using namespace attend_detail;

// Units in flight per warp (the stage being read and kHalfStages - 1 loading). 2 measured ahead of 3
// and 4 (H200, batch 8 x 32k: docs/benchmarks/cuda/device_s39/r2_ab_compare.txt): the kernel waits
// on its own instructions, not on memory. (KVSLIM_HALF_STAGES: a build for such A/B runs.)
#ifndef KVSLIM_HALF_STAGES
#define KVSLIM_HALF_STAGES 2
#endif
constexpr int kHalfStages = KVSLIM_HALF_STAGES;
constexpr int kDecodeVectors = 4;  // query vectors a CTA takes: B's 8 columns are 2 digits (keys) or P's 2 parts (values) each

// A unit's scores may pass the softmax's reference by this much (log2 units) before it moves: P =
// 2^(s - m_run) <= 2^8 then.
constexpr float kLeanSlack = 8.f;

// A group's q' = q * key scale for four consecutive channels (out), from q (fp32, q[0..3], 16-byte
// aligned) and the group's fp16 key scales and zeros (scale[0..3], zero[0..3]; 8-byte aligned);
// qz += q . zero over them. Returns the four's largest |q'|.
__device__ __forceinline__ float quad_q_prime(const float* q, const __half* scale, const __half* zero, float (&out)[4],
                                              float& qz) {
  const float4 q4 = *reinterpret_cast<const float4*>(q);
  const uint2 sw = *reinterpret_cast<const uint2*>(scale), zw = *reinterpret_cast<const uint2*>(zero);
  const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sw.x));
  const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sw.y));
  const float2 z01 = __half22float2(*reinterpret_cast<const __half2*>(&zw.x));
  const float2 z23 = __half22float2(*reinterpret_cast<const __half2*>(&zw.y));
  out[0] = q4.x * s01.x;
  out[1] = q4.y * s01.y;
  out[2] = q4.z * s23.x;
  out[3] = q4.w * s23.y;
  qz = fmaf(q4.x, z01.x, fmaf(q4.y, z01.y, fmaf(q4.z, z23.x, fmaf(q4.w, z23.y, qz))));
  return fmaxf(fmaxf(fabsf(out[0]), fabsf(out[1])), fmaxf(fabsf(out[2]), fabsf(out[3])));
}

// N consecutive fp16 values from shared memory (aligned to 2N bytes, N = 2, 4, 8 or 16) as floats.
template <int N>
__device__ __forceinline__ void load_halves(const __half* p, float* out) {
  static_assert(N == 2 || N % 4 == 0, "2, 4, 8 or 16 halves");
  if constexpr (N == 2) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(p));
    out[0] = f.x;
    out[1] = f.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint2 w = *reinterpret_cast<const uint2*>(p + i);
      const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
      const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
      out[i] = f0.x;
      out[i + 1] = f0.y;
      out[i + 2] = f1.x;
      out[i + 3] = f1.y;
    }
  }
}

// Per warp: kHalfStages unit stages [key codes | value codes | newest position], kHalfStages parameter
// slots [key scale, zero | value scale, zero] (group g's in slot g % kHalfStages: the groups of
// the units in flight are consecutive, so they never share a slot), P's digits (8 columns x 8
// k-blocks of 4 s8 digits, HalfCodeMap::p_word). After the warps: q (times the logit scale) of the 4
// vectors, [vector][D] fp32.
template <int KB, int VB, int D>
struct HalfShape {
  using KMap = CodeMap<KB, D>;
  using VMap = HalfCodeMap<VB, D>;
  static constexpr int K_CODE_BYTES = kGroupRows * KMap::RB;
  static constexpr int V_CODE_BYTES = kGroupRows * VMap::RB;
  static constexpr int PARAM_BYTES = 2 * D * 2;  // scale row + zero row, fp16
  static constexpr int POS_OFFSET = K_CODE_BYTES + V_CODE_BYTES;
  static constexpr int STAGE = POS_OFFSET + 16;
  static constexpr int PSLOT = 2 * PARAM_BYTES;
  static constexpr int PBUF = 2 * kDecodeVectors * kGroupRows;
  static constexpr int WARP_BYTES = kHalfStages * STAGE + kHalfStages * PSLOT + PBUF;
  static constexpr int QV = kDecodeVectors * D * 4;
  static constexpr int RED = kWarps * kTileRows * (D + 2) * 4;
  static constexpr int SMEM = kWarps * WARP_BYTES + QV > RED ? kWarps * WARP_BYTES + QV : RED;
  static_assert(STAGE % 16 == 0 && WARP_BYTES % 16 == 0, "stages must be whole 16-byte chunks");
};

// A unit's steps, one place for the kernels that run them (the single warp's here; the pairs of
// warps, measured and kept out in docs/benchmarks/cuda/pending_s60, call them too). Lane (g, t)
// holds column g of the products' B (vector g / 2, part g % 2: digits 3 / 2 and 1 / 0 of q', P's
// hi / lo part) and vector t's softmax and output channels (value_channel(i, g)).
template <int KB, int VB, int D>
struct HalfSteps {
  using KMap = CodeMap<KB, D>;
  using VMap = HalfCodeMap<VB, D>;
  using IK = InPlaceKeyMap<KB, D>;  // the keys' registers and q' digits
  using Order = HalfUnitOrder;      // the unit's tokens in the value product, P's layout (fragment_maps.h)
  static constexpr int KRB = KMap::RB, KW = KMap::KW, NR = KMap::NR, KS = KMap::KS;  // NR: D / 16 registers a token
  static constexpr int VRB = VMap::RB, BPLV = VMap::BPLV, NWV = VMap::NWV, NC = VMap::NC, MT = VMap::MT;

  // 1. At a group's first unit: column g's digits of q' = q * key scale, relative to the vector's
  //    largest |q'| (bq: [0, NR) the first mma's, then the second's); vector t's scale and q . zero.
  //    qv: vector g / 2's q [D]; kp: the group's key scales [D] then zeros [D].
  //    lo_part: g % 2 (the kernel's, computed once).
  __device__ __forceinline__ static void q_digits(const float* qv, const __half* kp, bool lo_part, int t,
                                                  std::uint32_t (&bq)[2 * NR], float& qscale, float& bias) {
    // Column g of the two mma: vector g / 2, digits 3 / 2 (g even / odd) in the first, 1 / 0 in
    // the second. Lanes g = 2v and 2v + 1 each build half of the registers' digits and trade what
    // the other's columns take (shuffle xor 4).
    constexpr int HALF = NR / 2;
    const int half = lo_part ? 1 : 0;
    float qp[HALF][4];
    float amax = 0.f, qz = 0.f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      // Register half * HALF + i: four consecutive channels, their q, key scales and zeros.
      const int c0 = IK::Map::key_channel(half * HALF + i, 0, t);
      amax = fmaxf(amax, quad_q_prime(qv + c0, kp + c0, kp + D + c0, qp[i], qz));
    }
    amax = max_over(amax, 1, 8);  // the 4 t lanes of both lanes of the vector: all its channels
    qz = sum_over(qz, 1, 8);
    const float inv = amax > 0.f ? 1.f / amax : 0.f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      // q' / max|q'| * 2^scale_bits, the power of two taken into 1 / max|q'| (exact: the same bits).
      const float inv_r = inv * pow2i(IK::scale_bits(half * HALF + i));
      const float y[4] = {qp[i][0] * inv_r, qp[i][1] * inv_r, qp[i][2] * inv_r, qp[i][3] * inv_r};
      std::uint32_t d[4];  // digit j of the 4 channels
      IK::scaled_q_digits(y, d);
      const std::uint32_t mine1 = lo_part ? d[2] : d[3], other1 = lo_part ? d[3] : d[2];
      const std::uint32_t mine2 = lo_part ? d[0] : d[1], other2 = lo_part ? d[1] : d[0];
      const std::uint32_t recv1 = __shfl_xor_sync(0xffffffffu, other1, 4);
      const std::uint32_t recv2 = __shfl_xor_sync(0xffffffffu, other2, 4);
      bq[i] = half ? recv1 : mine1;
      bq[HALF + i] = half ? mine1 : recv1;
      bq[NR + i] = half ? recv2 : mine2;
      bq[NR + HALF + i] = half ? mine2 : recv2;
    }
    qscale = __shfl_sync(0xffffffffu, amax * (1.f / static_cast<float>(1u << IK::kTotalBits)), 8 * t);  // lane (2t, 0)
    bias = __shfl_sync(0xffffffffu, qz, 8 * t);
  }

  // 2. Scores of tokens 16 mt + g (+ 8 rh) for vector t: the unit's key codes kc as A, q' digits as B.
  __device__ __forceinline__ static void scores(const unsigned char* kc, int g, int t, const std::uint32_t (&bq)[2 * NR],
                                                float qscale, float bias, float (&sc)[2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      std::uint32_t w0[KW], w1[KW];
      load_words<KW>(kc + (16 * mt + g) * KRB + t * (KRB / 4), w0);
      load_words<KW>(kc + (16 * mt + g + 8) * KRB + t * (KRB / 4), w1);
      int c1[4], c2[4];  // digits 3, 2 and 1, 0 of vector t: columns 2t, 2t + 1
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const std::uint32_t a0 = IK::key_reg(w0, 2 * ks), a1 = IK::key_reg(w1, 2 * ks);
        const std::uint32_t a2 = IK::key_reg(w0, 2 * ks + 1), a3 = IK::key_reg(w1, 2 * ks + 1);
        if (ks == 0) {
          imma16832_from(c1, a0, a1, a2, a3, bq[0], bq[1], kSumBias);
          imma16832_from(c2, a0, a1, a2, a3, bq[NR], bq[NR + 1], kSumBias);
        } else {
          imma16832(c1, a0, a1, a2, a3, bq[2 * ks], bq[2 * ks + 1]);
          imma16832(c2, a0, a1, a2, a3, bq[NR + 2 * ks], bq[NR + 2 * ks + 1]);
        }
      }
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const float sum = fmaf(sum_of(c1[2 * rh]), 16777216.f,
                               fmaf(sum_of(c1[2 * rh + 1]), 65536.f, fmaf(sum_of(c2[2 * rh]), 256.f, sum_of(c2[2 * rh + 1]))));
        sc[mt][rh] = fmaf(sum, qscale, bias);
      }
    }
  }

  // The unit's rows one by one (a lane past the tile's vectors, a unit that runs past the sequence's
  // rows or holds a row newer than the query): -inf where masked. upos: the unit's positions.
  __device__ __forceinline__ static void mask(const std::int64_t* upos, long long row0, int seq_limit, std::int64_t qpos,
                                              bool valid, int g, float (&sc)[2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const int tok = 16 * mt + g + 8 * rh;
        const bool keep = valid && row0 + tok < seq_limit && upos[tok] <= qpos;
        sc[mt][rh] = keep ? sc[mt][rh] : -INFINITY;
      }
    }
  }

  // The unit's logits of vector t (rows g + 8 j) at dst (a.logits at row0 + g): 4 stores.
  __device__ __forceinline__ static void write_logits(float* dst, const float (&sc)[2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) dst[16 * mt + 8 * rh] = sc[mt][rh];
    }
  }
  // A unit of padding only (not loaded): its rows' logits as a masked row's, -inf (dst as above).
  __device__ __forceinline__ static void padding_logits(float* dst) {
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[8 * j] = -INFINITY;
  }

  // P' (the unit's P of vector t over its largest, in [0, 1]) of the lane's tokens g + 8 j (j = 2 mt +
  // rh) as two digit words, k-block g of columns 2t (hi) and 2t + 1 (lo), at pw (HalfCodeMap::p_word).
  __device__ __forceinline__ static void store_p_digits(const float (&pf)[2][2], std::uint32_t* pw, int g, int t) {
    std::uint32_t hi, lo;
    VMap::pack_p_digits(float_bits(pf[0][0]), float_bits(pf[0][1]), float_bits(pf[1][0]), float_bits(pf[1][1]), hi, lo);
    pw[VMap::p_word(2 * t, g)] = hi;
    pw[VMap::p_word(2 * t + 1, g)] = lo;
  }

  // 4. Values: cvf[i] += uscale * sum_t P'_t code_t * 2^value_shift(i) of channel value_channel(i, g)
  //    for vector t: the codes of k-blocks t and t + 4 (tokens kb + 8 j of the unit's value codes vc)
  //    gathered by byte and masked in place as A, column g of P's digits (pw) as B; a row's hi and lo
  //    sums joined as integers (|256 hi + lo| < 2^31: 32 tokens, codes < 256, digits <= 128) and
  //    converted once.
  __device__ __forceinline__ static void values(const unsigned char* vc, const std::uint32_t* pw, int g, int t,
                                                float uscale, float (&cvf)[NC]) {
    std::uint32_t w[2][4][NWV];  // k-blocks t and t + 4: the lane's bytes of tokens kb + 8 j
    load_quad_rows<BPLV, NWV, Order::kRowStride * VRB>(vc + Order::value_token(t, 0) * VRB + g * BPLV, w[0]);
    load_quad_rows<BPLV, NWV, Order::kRowStride * VRB>(vc + Order::value_token(t + 4, 0) * VRB + g * BPLV, w[1]);
    const uint2 bw = *reinterpret_cast<const uint2*>(pw + VMap::p_word(g, t));  // column g, k-blocks t, t + 4
    std::uint32_t x[2][BPLV];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int n = 0; n < NWV; ++n) gather_quad(w[h][0][n], w[h][1][n], w[h][2][n], w[h][3][n], BPLV >= 4 ? 4 : BPLV, x[h] + 4 * n);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      int c[4];  // rows g, g + 8 x columns 2t (hi), 2t + 1 (lo)
      imma16832_from(c, VMap::value_reg(x[0], 2 * mt), VMap::value_reg(x[0], 2 * mt + 1), VMap::value_reg(x[1], 2 * mt),
                     VMap::value_reg(x[1], 2 * mt + 1), bw.x, bw.y, 0);
      cvf[2 * mt] = fmaf(static_cast<float>(c[0] * 256 + c[1]), uscale, cvf[2 * mt]);
      cvf[2 * mt + 1] = fmaf(static_cast<float>(c[2] * 256 + c[3]), uscale, cvf[2 * mt + 1]);
    }
  }

  // 5. At a group's last unit: acc += scale * sums * 2^-value_shift / kCodeUnit + zero * sum of P (acc
  //    and psum, the group's sum of P of vector t, both times kCodeUnit: one multiply a group, not one
  //    a channel); the group's sums cvf start again from zero. vp: the group's value scales [D] then
  //    zeros [D].
  __device__ __forceinline__ static void fold_group(const __half* vp, int g, float psum, float (&cvf)[NC], float (&acc)[NC]) {
    // Plane j's channels of this lane are BPLV consecutive ones (g BPLV + j RB + byte): read as words.
#pragma unroll
    for (int j = 0; j < VMap::NJ; ++j) {
      float vs[BPLV], vz[BPLV];
      load_halves<BPLV>(vp + VMap::value_channel(j, g), vs);
      load_halves<BPLV>(vp + D + VMap::value_channel(j, g), vz);
      const float unshift = 1.f / static_cast<float>(1u << VMap::value_shift(j));  // (exact: a power of two)
#pragma unroll
      for (int bi = 0; bi < BPLV; ++bi) {
        const int i = bi * VMap::NJ + j;
        acc[i] = fmaf(cvf[i] * unshift, vs[bi], fmaf(vz[bi], psum, acc[i]));
        cvf[i] = 0.f;
      }
    }
  }
};

// CTAs per SM the registers are sized for (KVSLIM_HALF_CTAS_D128: a build for A/B runs).
#ifndef KVSLIM_HALF_CTAS_D128
#define KVSLIM_HALF_CTAS_D128 3
#endif
constexpr int half_min_ctas(int D) { return D == 128 ? KVSLIM_HALF_CTAS_D128 : 4; }

// The kernel's forms, by how a store's units make groups and which of them hold rows. Each is a form
// of its own so that the others carry none of its bookkeeping:
//   kWholeGroups:   groups of rows.group_units units, every unit read (kivi's caches).
//   kSkipsPadding:  the same groups, and rows.region_rows (an eviction store's regions): units of
//                   padding only are neither loaded nor computed. (The flags cost 2-7 registers;
//                   4-8 bytes of spills in the 8-bit-key forms, which are not built: launch_half_codes.)
//   kFlaggedStarts: groups of varying length (zipcache's sets): parameters stored per unit
//                   (group_units 1), a group beginning where rows.unit_starts says. (Its flags'
//                   ballot and branches cost kivi's forms ~43 of a unit's ~840 instructions when
//                   every form carried them: docs/cuda.md, Next item 0.)
enum class UnitForm { kWholeGroups, kSkipsPadding, kFlaggedStarts };

// A warp's stream of units, from w_begin in order: which unit each stage holds, whether it begins a
// group, whether it holds rows, and which parameter slot its group's parameters load into. Each warp
// that loads units keeps one (pending_s60's pairs: both warps of a pair, so that they agree on every
// unit's place without a word between them); the callers copy the bytes.
//   Where groups begin: every GU-th unit (iwi, the next unit's place in its group), or, in the
//   flagged form, where rows.unit_starts says (GU 1: parameters stored per unit, read at a group's
//   first unit only; the flags of 32 units at a time, one byte a lane, kept as a ballot).
//   Units of padding only (kSkipsPadding: an eviction store's regions, rows at the front,
//   rows.region_rows): unit u holds rows iff its place in its group is below its region's count. The
//   units are issued in order from w_begin: 32 units' flags at a time, one count a lane, kept as a
//   ballot; each refresh loads the counts of the next 32 (`pending`), so no issue waits for a load,
//   and the first units (the prologue's, issued before the first counts arrive) are loaded whole and
//   flagged after (prologue_flags). A group's units with rows come first, so a group whose first unit
//   is padding is padding whole.
//   A group's parameters go to slot (its ordinal from the warp's first group) % kHalfStages: the groups
//   of the units in flight are consecutive, so they never share a slot.
template <UnitForm kForm>
struct UnitStream {
  static constexpr bool kSkipsPadding = kForm == UnitForm::kSkipsPadding;
  static constexpr bool kFlaggedStarts = kForm == UnitForm::kFlaggedStarts;
  const PackedRows& rows;
  const int bh, lane, w_begin;
  const int GU;
  int iwi;
  unsigned starts_bits = 0;
  int starts_base = -64;
  unsigned live_bits = 0;
  int pending = 0;
  unsigned stage_begins = 0, stage_live = 0;  // bit = stage
  int u_load, load_group = -1, read_group = -1;

  __device__ __forceinline__ UnitStream(const PackedRows& r, int bh_, int lane_, int w_begin_)
      : rows(r), bh(bh_), lane(lane_), w_begin(w_begin_), GU(kFlaggedStarts ? 1 : r.group_units),
        iwi(w_begin_ - first_group() * GU), u_load(w_begin_) {
    if constexpr (kSkipsPadding) pending = region_count(w_begin + lane);
  }
  __device__ __forceinline__ int first_group() const { return GU > 0 ? w_begin / GU : 0; }

  // What the caller copies for the next unit, into `stage`.
  struct Load {
    bool live;          // the unit holds rows: its codes are copied
    bool params;        // it begins a group (or is the warp's first): the group's parameters, into param_slot
    int param_slot;     // [0, kHalfStages)
    bool next_params;   // the parameters' source moves to the next group's after this unit
  };
  __device__ __forceinline__ Load load(bool first, int stage, bool whole) {
    Load l;
    l.live = whole || unit_live(u_load);
    bool begins;
    if constexpr (kFlaggedStarts) {
      begins = starts_group(u_load);
    } else {
      begins = iwi == 0;
    }
    l.params = first || begins;
    if (l.params) ++load_group;
    l.param_slot = load_group % kHalfStages;
    l.next_params = first || iwi == 0;  // (stored per unit: the next unit's)
    stage_begins = (stage_begins & ~(1u << stage)) | (static_cast<unsigned>(begins) << stage);
    if constexpr (kSkipsPadding) stage_live = (stage_live & ~(1u << stage)) | (static_cast<unsigned>(l.live) << stage);
    ++u_load;
    if (++iwi == GU) iwi = 0;
    return l;
  }
  // After the prologue's units are issued: the first 32 units' flags; the prologue's units flagged now.
  __device__ __forceinline__ void prologue_flags() {
    if constexpr (kSkipsPadding) {
      live_bits = refresh_live(w_begin, pending);
      pending = region_count(w_begin + 32 + lane);
      stage_live = live_bits & ((1u << (kHalfStages - 1)) - 1u);  // (units 0.. are stages 0..)
    }
  }
  // Unit k of n's place in its group when it is read (and the read group's parameter slot moves on).
  // last: the group's last unit with rows (the next begins a group or holds padding only).
  __device__ __forceinline__ void read(int k, int n, bool& first, bool& last) {
    first = k == 0 || ((stage_begins >> (k % kHalfStages)) & 1u);
    last = k + 1 == n || ((stage_begins >> ((k + 1) % kHalfStages)) & 1u) ||
           (kSkipsPadding && !((stage_live >> ((k + 1) % kHalfStages)) & 1u));
    if (first) ++read_group;
  }
  __device__ __forceinline__ int read_slot() const { return read_group % kHalfStages; }
  // Unit k (being read) is padding only: nothing was loaded, nothing to add.
  __device__ __forceinline__ bool padding(int k) const {
    return kSkipsPadding && !((stage_live >> (k % kHalfStages)) & 1u);
  }

 private:
  __device__ __forceinline__ bool starts_group(int u) {
    if (u >= starts_base + 32) {
      starts_base = u;
      starts_bits = __ballot_sync(0xffffffffu, u + lane < rows.n_units && rows.unit_starts[u + lane] != 0);
    }
    return ((starts_bits >> (u - starts_base)) & 1u) != 0;
  }
  __device__ __forceinline__ int region_count(int v) const {  // unit v's region's rows (0 past the units)
    return v < rows.n_units ? rows.region_rows[bh * rows.region_rows_stride + v / GU] : 0;
  }
  __device__ __forceinline__ unsigned refresh_live(int base, int counts) const {  // flags of units base + lane
    const int v = base + lane;
    return __ballot_sync(0xffffffffu, v < rows.n_units && (v % GU) * kGroupRows < counts);
  }
  __device__ __forceinline__ bool unit_live(int u) {
    if constexpr (!kSkipsPadding) return true;
    const int i = u - w_begin;
    if ((i & 31) == 0 && i > 0) {  // (units 0..31: flagged after the prologue)
      live_bits = refresh_live(u, pending);
      pending = region_count(u + 32 + lane);
    }
    return ((live_bits >> (i & 31)) & 1u) != 0;
  }
};

template <int KB, int VB, int D, UnitForm kForm>
__global__ void __launch_bounds__(kThreads, half_min_ctas(D))
    attend_codes_half_kernel(QueryArgs a, PackedRows rows, Partials parts, int part_base, int units_per_split) {
  using Shape = HalfShape<KB, VB, D>;
  using KMap = typename Shape::KMap;
  using VMap = typename Shape::VMap;
  using Steps = HalfSteps<KB, VB, D>;
  static_assert(std::is_same_v<typename Steps::IK::Map, KMap>, "the stages' key rows are the int8 map's");
  constexpr int NR = KMap::NR, NC = VMap::NC, MT = VMap::MT;  // NR: D / 16 registers a token
  constexpr int K_CODE_BYTES = Shape::K_CODE_BYTES, STAGE = Shape::STAGE, PSLOT = Shape::PSLOT;
  constexpr int PARAM_BYTES = Shape::PARAM_BYTES;
  extern __shared__ __align__(16) unsigned char smem[];

  pdl_launch_dependents();  // the window's dense rows and the merge may launch (attend_shared.cuh)
  // The thread index as an int through an empty asm, so that what derives from it -- lane, g, t,
  // the stage addresses -- is kept or recomputed from a register, not read again from SR_TID each
  // unit (13-26 fewer instructions a unit, stop 50's census).
  int tid = threadIdx.x;
  asm("" : "+r"(tid));
  const int lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int tile = blockIdx.y, bh = blockIdx.z, b = bh / a.Hkv, h = bh % a.Hkv;
  const long long SG = static_cast<long long>(a.S) * a.G;
  unsigned char* my = smem + warp * Shape::WARP_BYTES;
  float* qs = reinterpret_cast<float*>(smem + kWarps * Shape::WARP_BYTES);  // [vector][D]

  // B column g: vector g / 2, part g % 2 (1 = lo). Softmax and output: vector t.
  const int bvec = g / 2;
  const bool lo_part = g % 2;
  const long long vec = static_cast<long long>(tile) * kTileRows + t;
  const bool valid = vec < SG;
  const std::int64_t qpos = !valid ? INT64_MIN : a.qpos ? a.qpos[vec / a.G] : a.qpos_inline[vec / a.G];
  float m_run = -INFINITY, l_run = 0.f, acc[NC];
#pragma unroll
  for (int i = 0; i < NC; ++i) acc[i] = 0.f;
  float cvf[NC];  // the current group's sum_t P code * 2^value_shift(i) * kCodeUnit, channel value_channel(i, g), vector t
#pragma unroll
  for (int i = 0; i < NC; ++i) cvf[i] = 0.f;
  float psum_g = 0.f;
  const int seq_limit = a.seq_rows ? a.seq_rows[b] : INT32_MAX;

  const int u_begin = blockIdx.x * units_per_split;
  const int u_end = min(rows.n_units, u_begin + units_per_split);
  const unsigned char* kc_head = rows.k_codes + bh * rows.k_codes_stride;
  const unsigned char* vc_head = rows.v_codes + bh * rows.v_codes_stride;
  const std::uint16_t* kp_head = rows.k_params + bh * rows.params_stride;
  const std::uint16_t* vp_head = rows.v_params + bh * rows.params_stride;
  // Each warp takes a quarter of the split's units, contiguous (a warp's first and last group may be
  // shared with its neighbours: each builds its own q' and applies its own sums): the longest chain
  // of units a warp runs is what a batch-1 call waits for, and whole groups per warp left one warp of
  // four with two groups where the others had one.
  const int n_split = max(0, u_end - u_begin);
  const int w_begin = u_begin + n_split * warp / kWarps;
  const int n_mine = u_begin + n_split * (warp + 1) / kWarps - w_begin;
  UnitStream<kForm> stream(rows, bh, lane, w_begin);
  // The next unit to load, as pointers advanced unit by unit; every lane copies 16-byte chunks
  // lane, lane + 32, ... A group's parameters come with its first unit the warp loads.
  const unsigned char* k_next = kc_head + static_cast<long long>(w_begin) * K_CODE_BYTES + 16 * lane;
  const unsigned char* v_next = vc_head + static_cast<long long>(w_begin) * Shape::V_CODE_BYTES + 16 * lane;
  const std::int64_t* pos_next = rows.pos + bh * rows.pos_head_stride + static_cast<long long>(w_begin) * kGroupRows + kGroupRows - 1;
  const int first_group = stream.first_group();
  const unsigned char* kp_next =
      reinterpret_cast<const unsigned char*>(kp_head + static_cast<long long>(first_group) * 2 * D) + 16 * lane;
  const unsigned char* vp_next =
      reinterpret_cast<const unsigned char*>(vp_head + static_cast<long long>(first_group) * 2 * D) + 16 * lane;
  constexpr int K_CHUNKS = K_CODE_BYTES / 16, V_CHUNKS = Shape::V_CODE_BYTES / 16, P_CHUNKS = PARAM_BYTES / 16;
  // The warp's stages as one address in the shared window (this lane's 16 bytes) and as an offset
  // from smem, held in registers for the loop, as is the count of units (the empty asm below):
  // else the compiler re-derives them from the thread index and the CTA's shared window (S2R) every
  // unit, a quarter of the unit's bookkeeping stalls in stop 49's samples.
  unsigned my_to = static_cast<unsigned>(__cvta_generic_to_shared(my)) + 16 * lane;
  int my_off = warp * Shape::WARP_BYTES;
  // Where this lane's 16 bytes at `offset` from my land (lane_bytes false: the byte at `offset`
  // itself), as an address in the shared window.
  const auto to = [&](int offset, bool lane_bytes = true) { return my_to + offset - (lane_bytes ? 0 : 16 * lane); };
  auto issue = [&](bool first, int stage, bool whole = false) {
    const auto l = stream.load(first, stage, whole);
    if (l.live) {
#pragma unroll
      for (int i = 0; i < K_CHUNKS; i += 32) {
        if (K_CHUNKS % 32 == 0 || i + lane < K_CHUNKS) cp_async16_to(to(stage * STAGE + 16 * i), k_next + 16 * i);
      }
#pragma unroll
      for (int i = 0; i < V_CHUNKS; i += 32) {
        if (V_CHUNKS % 32 == 0 || i + lane < V_CHUNKS) {
          cp_async16_to(to(stage * STAGE + K_CODE_BYTES + 16 * i), v_next + 16 * i);
        }
      }
    }
    if (l.params) {
      const int slot = kHalfStages * STAGE + l.param_slot * PSLOT;  // from my
#pragma unroll
      for (int i = 0; i < P_CHUNKS; i += 32) {
        if (l.live && (P_CHUNKS % 32 == 0 || i + lane < P_CHUNKS)) {
          cp_async16_to(to(slot + 16 * i), kp_next + 16 * i);
          cp_async16_to(to(slot + PARAM_BYTES + 16 * i), vp_next + 16 * i);
        }
      }
    }
    if (l.next_params) {
      kp_next += PARAM_BYTES;
      vp_next += PARAM_BYTES;
    }
    cp_async8_if_to(lane == 0 && l.live, to(stage * STAGE + Shape::POS_OFFSET, false), pos_next);
    k_next += K_CODE_BYTES;
    v_next += Shape::V_CODE_BYTES;
    pos_next += kGroupRows;
  };

  static_assert(kHalfStages >= 2, "a unit loads while another is read");
#pragma unroll
  for (int s = 0; s < kHalfStages - 1; ++s) {
    if (s < n_mine) issue(s == 0, s, true);
    cp_async_commit();
  }
  // q after the first units' copies are issued: its loads' latency overlaps theirs (batch 1 waits
  // for both).
  load_tile_queries<kDecodeVectors, D>(a, tile, b, h, qs);
  stream.prologue_flags();
  __syncthreads();
  std::uint32_t bq[2 * NR];  // the current group's q' digits for column g: [0, NR) the first mma's, then the second's
  float qscale = 0.f, bias = 0.f;
  float uscale = 0.f;  // the current unit's digit sums to P * kCodeUnit (vector t)
  int n_units = n_mine;
  for (int k = 0; k < n_units; ++k) {
    asm("" : "+r"(n_units), "+r"(my_to), "+r"(my_off));  // held, not re-derived (above)
    if (k + kHalfStages - 1 < n_units) issue(false, (k + kHalfStages - 1) % kHalfStages);
    // (Unit k + 1 is in flight already: kHalfStages >= 2.)
    bool first_of_group, last_of_group;
    stream.read(k, n_units, first_of_group, last_of_group);
    cp_async_commit();
    cp_async_wait<kHalfStages - 1>();
    __syncwarp();

    const int u = w_begin + k;
    if (stream.padding(k)) {  // padding only: nothing loaded, nothing to add
      if (a.logits && valid) Steps::padding_logits(a.logits + (static_cast<long long>(bh) * SG + vec) * a.rows_total + rows.row_offset +
                                                   static_cast<long long>(u) * kGroupRows + g);
      continue;
    }
    unsigned char* const my_k = smem + my_off;  // = my
    const unsigned char* buf = my_k + (k % kHalfStages) * STAGE;
    std::uint32_t* const pw = reinterpret_cast<std::uint32_t*>(my_k + kHalfStages * (STAGE + PSLOT));  // P's digits (p_word)
    const unsigned char* kc = buf;
    const unsigned char* vc = buf + K_CODE_BYTES;
    const unsigned char* pslot = my_k + kHalfStages * STAGE + stream.read_slot() * PSLOT;
    const __half* kp = reinterpret_cast<const __half*>(pslot);
    const __half* vp = reinterpret_cast<const __half*>(pslot + PARAM_BYTES);

    // 1. At a group's first unit (or the warp's first): column g's digits of q' (Steps::q_digits).
    if (first_of_group) Steps::q_digits(qs + bvec * D, kp, lo_part, t, bq, qscale, bias);

    // 2. Scores of tokens 16 mt + g (+ 8) for vector t: keys as A, q' digits as B.
    float sc[2][2];
    Steps::scores(kc, g, t, bq, qscale, bias, sc);

    // 3. Online softmax of vector t over the unit; P's digits into pw.
    const long long row0 = rows.row_offset + static_cast<long long>(u) * kGroupRows;
    const std::int64_t newest = *reinterpret_cast<const std::int64_t*>(buf + Shape::POS_OFFSET);
    {
      // A lane past the tile's vectors, a unit that runs past the sequence's rows or holds a row
      // newer than the query (causal by true position): rows checked one by one. Others: kept whole.
      if (!valid || row0 + kGroupRows > seq_limit || newest > qpos) {
        Steps::mask(rows.pos + bh * rows.pos_head_stride + static_cast<long long>(u) * kGroupRows, row0, seq_limit, qpos,
                    valid, g, sc);
      }
      float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));  // this lane's rows
      if (a.logits && valid) Steps::write_logits(a.logits + (static_cast<long long>(bh) * SG + vec) * a.rows_total + row0 + g, sc);
      mx = max_over(mx, 4, 32);  // the unit's largest score of vector t (its 8 g lanes): P's digits are relative to it
      // The reference moves only past the slack (m_run -inf: any finite score passes it).
      if (__any_sync(0xffffffffu, mx > m_run + kLeanSlack)) {
        const float m_new = fmaxf(m_run, mx);
        const float alpha = exp2_sfu(m_run - (m_new == -INFINITY ? 0.f : m_new));
        if (__any_sync(0xffffffffu, m_run != -INFINITY && alpha != 1.f)) {  // else acc holds zeros or stays
#pragma unroll
          for (int i = 0; i < NC; ++i) acc[i] *= alpha;
#pragma unroll
          for (int i = 0; i < NC; ++i) cvf[i] *= alpha;
          psum_g *= alpha;
          l_run *= alpha;
        }
        m_run = m_new;
      }
      // P' = P / the unit's largest P of vector t, in [0, 1] (that largest, 2^(mx - m_run), is at
      // most 2^kLeanSlack); a vector whose rows are all masked has P' 0 and no weight.
      const float msub = m_run == -INFINITY ? 0.f : m_run;
      const float unit_p = mx == -INFINITY ? 0.f : exp2_sfu(mx - msub), mref = mx == -INFINITY ? 0.f : mx;
      uscale = unit_p * (VMap::kCodeUnit / VMap::kDigitRange);
      float pf[2][2];  // kDigitBias + round(P' kDigitRange): the digits, and the weight they carry
      float ps = 0.f;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const float p = exp2_sfu(sc[mt][rh] - mref);
          ps += p;
          pf[mt][rh] = VMap::digit_float(p);
        }
      }
      // The zero points weigh the rows as the codes' sums do, by the rounded P' (exact integers:
      // each bracket is v + v'). With P itself, every row's rounding (2^-16 of the unit's largest P)
      // would meet code * scale -- up to a channel's whole range -- rather than the value: ~5x the
      // error (bench/cuda/p_digits_error.py). The softmax's sum stays P's own, so the probabilities
      // keep their precision (the output's error is the same either way).
      constexpr float kTwoBiases = 2.f * VMap::kDigitBias;
      psum_g += ((pf[0][0] + (pf[0][1] - kTwoBiases)) + (pf[1][0] + (pf[1][1] - kTwoBiases))) * uscale;
      l_run += ps * unit_p;  // this lane's rows: summed over the vector's lanes at the end
      Steps::store_p_digits(pf, pw, g, t);
    }
    __syncwarp();

    // 4. Values: cvf += the unit's sum_t P code * 2^value_shift * kCodeUnit (Steps::values).
    Steps::values(vc, pw, g, t, uscale, cvf);
    // 5. At a group's last unit (or the warp's last): the group's sums into acc (Steps::fold_group;
    //    acc holds the output times kCodeUnit until the loop ends).
    if (last_of_group) {
      Steps::fold_group(vp, g, sum_over(psum_g, 4, 32), cvf, acc);
      psum_g = 0.f;
    }
    __syncwarp();  // pw and this stage are written again next
  }
  cp_async_wait<0>();
  l_run = sum_over(l_run, 4, 32);  // each lane summed its own rows' P
#pragma unroll
  for (int i = 0; i < NC; ++i) acc[i] /= VMap::kCodeUnit;  // (step 5; exact: a power of two)

  __syncthreads();  // every warp is done with its stages: the memory becomes the merge scratch
  float* red = reinterpret_cast<float*>(smem);
  float* red_ml = red + kWarps * kTileRows * D;
#pragma unroll
  for (int i = 0; i < NC; ++i) red[(warp * kTileRows + t) * D + VMap::value_channel(i, g)] = acc[i];
  if (g == 0) {
    red_ml[(warp * kTileRows + t) * 2] = m_run;
    red_ml[(warp * kTileRows + t) * 2 + 1] = l_run;
  }
  __syncthreads();
  merge_warps<D>(a, tile, bh, red, parts, part_base + blockIdx.x);
  pdl_wait();  // launched early after another codes segment (part_base > 0): finish after it
}

// (Every form has the same launch bounds and shared memory: the same CTAs an SM.)
template <int KB, int VB, int D>
int half_resident() {
  static const int n = [] {
    constexpr int smem = HalfShape<KB, VB, D>::SMEM;
    set_smem_always(attend_codes_half_kernel<KB, VB, D, UnitForm::kWholeGroups>, smem);
    return resident_ctas(attend_codes_half_kernel<KB, VB, D, UnitForm::kWholeGroups>, smem);
  }();
  return n;
}

template <int KB, int VB, int D, UnitForm kForm>
void half_launch(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                 int units_per_split, cudaStream_t stream) {
  constexpr int smem = HalfShape<KB, VB, D>::SMEM;
  auto kernel = attend_codes_half_kernel<KB, VB, D, kForm>;
  static std::atomic<unsigned long long> done{0};
  set_smem(kernel, smem, done);
  launch_kernel(splits > 0, part_base > 0, kernel, dim3(splits, q.tiles(), q.B * q.Hkv), dim3(kThreads), smem, stream, q, rows,
                parts, part_base, units_per_split);
}

// f<KB, VB, D>() for the widths and head_dim of `rows` / `q` (checked by the caller).
template <typename F>
void with_half_kernel(const QueryArgs& q, const PackedRows& rows, F&& f) {
  auto values = [&]<int KB, int D>() {
    switch (rows.v_bits) {
      case 2: return f.template operator()<KB, 2, D>();
      case 4: return f.template operator()<KB, 4, D>();
      default: return f.template operator()<KB, 8, D>();
    }
  };
  auto keys = [&]<int D>() {
    switch (rows.k_bits) {
      case 2: return values.template operator()<2, D>();
      case 4: return values.template operator()<4, D>();
      default: return values.template operator()<8, D>();
    }
  };
  q.D == 64 ? keys.template operator()<64>() : keys.template operator()<128>();
}

}  // namespace

// Groups of one unit (32 rows) stay on the int8 kernel: their q' is rebuilt every unit, where that
// kernel's int8 operands cost less (kivi2 / kivi4 at 32-row groups, batch 8 x 32k: 103.6 / 116.8 us
// on the int8 kernel against 116.2 / 131.6 us here; device_s39/r3_compare.txt).
// (KVSLIM_HALF_ONE_UNIT_GROUPS: a build that takes them too, for an A/B since the kernel's later
// forms.)
#ifndef KVSLIM_HALF_ONE_UNIT_GROUPS
#define KVSLIM_HALF_ONE_UNIT_GROUPS 0
#endif
bool half_codes_take(const QueryArgs& q, const PackedRows& rows) {
  return static_cast<long long>(q.S) * q.G <= kDecodeVectors &&
         (rows.group_units >= (KVSLIM_HALF_ONE_UNIT_GROUPS ? 1 : 2) || rows.unit_starts != nullptr);
}

int half_codes_resident(const QueryArgs& q, const PackedRows& rows) {
  int n = 2;
  with_half_kernel(q, rows, [&]<int KB, int VB, int D>() { n = half_resident<KB, VB, D>(); });
  return n;
}

void launch_half_codes(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                       int units_per_split, cudaStream_t stream) {
  with_half_kernel(q, rows, [&]<int KB, int VB, int D>() {
    if (rows.unit_starts != nullptr) {
      if (rows.group_units != 1) throw std::logic_error("attend: unit_starts needs parameters stored per unit (group_units 1)");
      half_launch<KB, VB, D, UnitForm::kFlaggedStarts>(q, rows, parts, part_base, splits, units_per_split, stream);
      return;
    }
    // (8-bit keys keep every unit: the flags spill registers in those forms; padding is masked.)
    if constexpr (KB < 8) {
      if (rows.region_rows != nullptr && rows.group_units > 0) {
        half_launch<KB, VB, D, UnitForm::kSkipsPadding>(q, rows, parts, part_base, splits, units_per_split, stream);
        return;
      }
    }
    half_launch<KB, VB, D, UnitForm::kWholeGroups>(q, rows, parts, part_base, splits, units_per_split, stream);
  });
}

}  // namespace kvslim::cuda
