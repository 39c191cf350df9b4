// Split-K attention over kivi codes (keys and values group-quantized per channel over groups of
// 32 * group_units rows, each at its own width, bit-packed in the CPU's plane layout) on the int8
// tensor cores: the codes go into
// mma.m16n8k32 as the u8 integers they are, against s8 operands, with exact s32 sums -- the scheme of
// the CPU's integer kernels (docs/methods.md), so both read the same bytes to the same tolerance.
//
//   keys:   q . k = sum_c (q_c scale_c) code_c + sum_c q_c zero_c per group. q' = q * scale is rounded
//           to 23-bit integers relative to its largest element and split v = 65536 hi + 256 mid + lo
//           into three s8 columns of the mma (error ~2^-23 of the largest |q'_c|: keys' outlier
//           channels make that largest element tens of times the rest, which the CPU's two bytes
//           (2^-15) feel), the codes are the A operand (rows = tokens), and the group's score is
//           (65536 S_hi + 256 S_mid + S_lo) * max / 2^22 + q . zero.
//   values: sum_t p_t v_tc = scale_c sum_t p_t code_tc + zero_c sum_t p_t; the group's
//           probabilities are rounded the same way relative to their largest and split into three s8
//           columns (two bytes, ~2^-15, let values' outliers show through the small weights); the
//           codes, transposed in registers, are the A operand (rows = channels).
//
// A tile is 8 query vectors, taken as NSUB sub-tiles of 4 (columns: vector n's high and middle bytes
// in columns 2n, 2n + 1 of one mma, its low bytes in columns 2n and 2n + 1 of a second), so the
// columns are used when a KV head has 4 query heads
// (Llama's 32/8) and a decode step needs one sub-tile. Each CTA = 4 warps takes a range of whole
// quantization groups of one (tile, b, h); each warp takes whole groups and streams their 32-row units
// global -> shared (cp.async, 2 stages; a group's parameters once, into one of two parameter slots),
// builds q' once per group, and keeps query vector t's online softmax and D/8 of its output channels
// in lane (g, t). The warps merge in
// shared memory and the CTA writes one partial (attend_shared.cuh); launch_combine merges the splits.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <string>

#include "cuda/attend.h"
#include "cuda/attend_codes_half.h"
#include "cuda/attend_shared.cuh"
#include "cuda/fragment_maps.h"

namespace kvslim::cuda {

bool supported_head_dim(int D) { return D == 64 || D == 128; }

namespace {

using namespace attend_detail;

constexpr int kCodeStages = 2;
constexpr float kOperandRange = 4194304.f;  // q' and P become integers in [-2^22, 2^22]

// Per warp: kCodeStages unit stages [key codes | value codes | newest position], two parameter slots
// [key scale, zero | value scale, zero] (a group's, alternating by group), the P digits. After the
// warps: q (times the logit scale) as each lane reads it to build q', once per CTA -- read at each
// group's start only, so it holds no registers through the units.
template <int KB, int VB, int D, int NSUB>
struct CodeShape {
  using KMap = CodeMap<KB, D>;
  using VMap = CodeMap<VB, D>;
  static constexpr int K_CODE_BYTES = kGroupRows * KMap::RB;
  static constexpr int V_CODE_BYTES = kGroupRows * VMap::RB;
  static constexpr int PARAM_BYTES = 2 * D * 2;  // scale row + zero row, fp16
  static constexpr int POS_OFFSET = K_CODE_BYTES + V_CODE_BYTES;  // the unit's newest position
  static constexpr int STAGE = POS_OFFSET + 16;
  static constexpr int PSLOT = 2 * PARAM_BYTES;
  static constexpr int PBUF = NSUB * 4 * 3 * kGroupRows;  // P digits [sub][vector][hi, mid, lo][token] (+128)
  static constexpr int WARP_BYTES = kCodeStages * STAGE + 2 * PSLOT + PBUF;
  static constexpr int QV = NSUB * (KMap::NR / 2) * 32 * 16;  // float4 [sub][register i][lane]: conflict-free
  static constexpr int RED = kWarps * kTileRows * (D + 2) * 4;
  static constexpr int SMEM = kWarps * WARP_BYTES + QV > RED ? kWarps * WARP_BYTES + QV : RED;
  static_assert(STAGE % 16 == 0 && WARP_BYTES % 16 == 0, "stages must be whole 16-byte chunks");
};

// CTAs per SM the registers are sized for. GROUPED (groups of 2+ units) keeps a group's q' and
// value sums in registers across its units: decode at 4 CTAs per SM (D = 128) or 5 (D = 64) spilled,
// hence one fewer.
constexpr int codes_min_ctas(int D, int NSUB, bool GROUPED) {
  return NSUB == 1 ? (D == 128 ? (GROUPED ? 3 : 4) : (GROUPED ? 4 : 5)) : (D == 128 ? 2 : 3);
}

// GROUPED: rows.group_units >= 2 (read at run time); else 1, known here, so nothing of q' lives
// across units.
template <int KB, int VB, int D, int NSUB, bool GROUPED>
__global__ void __launch_bounds__(kThreads, codes_min_ctas(D, NSUB, GROUPED))
    attend_codes_kernel(QueryArgs a, PackedRows rows, Partials parts, int part_base, int units_per_split) {
  using Shape = CodeShape<KB, VB, D, NSUB>;
  using KMap = typename Shape::KMap;
  using VMap = typename Shape::VMap;
  constexpr int KRB = KMap::RB, KW = KMap::KW, NR = KMap::NR, KS = KMap::KS;
  constexpr int VRB = VMap::RB, BPLV = VMap::BPLV, NWV = VMap::NWV;
  constexpr int NC = VMap::NC, HALF = NR / 2, MT = D / 16;
  constexpr int K_CODE_BYTES = Shape::K_CODE_BYTES, V_CODE_BYTES = Shape::V_CODE_BYTES;
  constexpr int PARAM_BYTES = Shape::PARAM_BYTES, STAGE = Shape::STAGE, PSLOT = Shape::PSLOT;
  extern __shared__ __align__(16) unsigned char smem[];

  pdl_launch_dependents();  // the window's dense rows and the merge may launch (attend_shared.cuh)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int tile = blockIdx.y, bh = blockIdx.z, b = bh / a.Hkv, h = bh % a.Hkv;
  const long long SG = static_cast<long long>(a.S) * a.G;
  unsigned char* my = smem + warp * Shape::WARP_BYTES;
  unsigned char* pslots = my + kCodeStages * STAGE;
  unsigned char* pbuf = pslots + 2 * PSLOT;
  float4* qvs = reinterpret_cast<float4*>(smem + kWarps * Shape::WARP_BYTES);
  // Column g of the mma: vector g / 2 of a sub-tile, part g % 2 (0 = high bytes). The lane builds
  // q' for key registers [half * HALF, half * HALF + HALF) and trades the other part with lane ^ 4.
  const int half = g % 2;

  // q (times the logit scale, log2 units) of the vector this lane builds q' for, its half's channels:
  // written once (warp 0) into qvs, the same for every warp's lane.
  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
      const long long m = static_cast<long long>(tile) * kTileRows + 4 * s + g / 2;
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[e] = 0.f;
          if (m < SG) {
            const long long sq = m / a.G, j = m % a.G;
            v[e] = a.q[((static_cast<long long>(b) * a.S + sq) * a.Hq + static_cast<long long>(h) * a.G + j) * D +
                       KMap::key_channel(half * HALF + i, e, t)] *
                   a.scale_log2;
          }
        }
        qvs[(s * HALF + i) * 32 + lane] = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
  }
  __syncthreads();
  // Vector t of each sub-tile: this lane's softmax row and NC of its output channels. GROUPED: the
  // group's value scale and zero are constant over its units, so its units add sum_t p_t code_tc
  // (times their P digits' scale) into vsum and sum_t p_t into psum_g, and scale and zero are applied
  // once, at the group's last unit (both rescaled with acc by the online softmax).
  float m_run[NSUB], l_run[NSUB], acc[NSUB][NC];
  float vsum[NSUB][GROUPED ? NC : 1] = {}, psum_g[NSUB] = {};
  bool valid[NSUB];
  std::int64_t qpos[NSUB];
#pragma unroll
  for (int s = 0; s < NSUB; ++s) {
    const long long vec = static_cast<long long>(tile) * kTileRows + 4 * s + t;
    valid[s] = vec < SG;
    qpos[s] = !valid[s] ? INT64_MIN : a.qpos ? a.qpos[vec / a.G] : a.qpos_inline[vec / a.G];
    m_run[s] = -INFINITY;
    l_run[s] = 0.f;
#pragma unroll
    for (int i = 0; i < NC; ++i) acc[s][i] = 0.f;
  }
  const int seq_limit = a.seq_rows ? a.seq_rows[b] : INT32_MAX;

  // The split's units are whole groups (codes_launch rounds units_per_split to group_units); its
  // groups are dealt to the warps round-robin, a group's units to one warp in order, so the warp
  // builds q' and reads the parameters once per group.
  const int GU = GROUPED ? rows.group_units : 1;
  const int u_begin = blockIdx.x * units_per_split;
  const int u_end = min(rows.n_units, u_begin + units_per_split);
  const unsigned char* kc_head = rows.k_codes + bh * rows.k_codes_stride;
  const unsigned char* vc_head = rows.v_codes + bh * rows.v_codes_stride;
  const std::uint16_t* kp_head = rows.k_params + bh * rows.params_stride;
  const std::uint16_t* vp_head = rows.v_params + bh * rows.params_stride;
  const int n_split_groups = u_end > u_begin ? (u_end - u_begin) / GU : 0;
  const int n_mine = warp < n_split_groups ? (n_split_groups - warp + kWarps - 1) / kWarps * GU : 0;
  const int group_begin = blockIdx.x * (units_per_split / GU);  // (the only divisions: none per unit)
  // Unit wi of the warp's gi-th group, and that group's index.
  auto group_at = [&](int gi) { return group_begin + warp + gi * kWarps; };
  auto unit_at = [&](int gi, int wi) { return group_at(gi) * GU + wi; };
  // One unit's stage: key codes, value codes, the newest position (every part a whole number of
  // 16-byte chunks: the loops' bounds are compile-time, no per-chunk branches); at a group's first
  // unit also the group's parameters, into the slot of the group's parity.
  auto issue = [&](int gi, int wi, int stage) {
    const int u = unit_at(gi, wi);
    unsigned char* dst = my + stage * STAGE;
    const long long kcode0 = static_cast<long long>(u) * K_CODE_BYTES, vcode0 = static_cast<long long>(u) * V_CODE_BYTES;
#pragma unroll
    for (int i = lane; i < K_CODE_BYTES / 16; i += 32) cp_async16(dst + 16 * i, kc_head + kcode0 + 16 * i);
#pragma unroll
    for (int i = lane; i < V_CODE_BYTES / 16; i += 32) cp_async16(dst + K_CODE_BYTES + 16 * i, vc_head + vcode0 + 16 * i);
    if (wi == 0) {
      unsigned char* pdst = pslots + (gi % 2) * PSLOT;
      const long long param0 = static_cast<long long>(group_at(gi)) * 2 * D;
      const unsigned char* kp_src = reinterpret_cast<const unsigned char*>(kp_head + param0);
      const unsigned char* vp_src = reinterpret_cast<const unsigned char*>(vp_head + param0);
#pragma unroll
      for (int i = lane; i < PARAM_BYTES / 16; i += 32) {
        cp_async16(pdst + 16 * i, kp_src + 16 * i);
        cp_async16(pdst + PARAM_BYTES + 16 * i, vp_src + 16 * i);
      }
    }
    cp_async8_if(lane == 0, dst + Shape::POS_OFFSET, rows.pos + bh * rows.pos_head_stride + static_cast<long long>(u) * kGroupRows + kGroupRows - 1);
  };

  static_assert(kCodeStages == 2, "the loop issues the next unit while it computes the current one");
  if (n_mine > 0) issue(0, 0, 0);
  cp_async_commit();
  // The current group's q' (step 1), kept across its units.
  std::uint32_t bq[NSUB][NR] = {}, bl[NSUB][NR] = {};
  float qscale[NSUB] = {}, bias[NSUB] = {};
  int gi = 0, wi = 0;  // the current unit: unit wi of the warp's gi-th group
  for (int k = 0; k < n_mine; ++k) {
    const bool last_of_group = wi + 1 == GU;
    const int next_gi = last_of_group ? gi + 1 : gi, next_wi = last_of_group ? 0 : wi + 1;
    if (k + 1 < n_mine) issue(next_gi, next_wi, (k + 1) % kCodeStages);
    cp_async_commit();
    cp_async_wait<kCodeStages - 1>();
    __syncwarp();

    const int u = unit_at(gi, wi);
    const unsigned char* buf = my + (k % kCodeStages) * STAGE;
    const unsigned char* kc = buf;
    const unsigned char* vc = buf + K_CODE_BYTES;
    const unsigned char* pslot = pslots + (gi % 2) * PSLOT;
    const __half* kp = reinterpret_cast<const __half*>(pslot);
    const __half* vp = reinterpret_cast<const __half*>(pslot + PARAM_BYTES);

    // 1. At a group's first unit: the s8 columns of q' = q * key scale (bq: high / middle bytes, bl:
    //    low bytes), their scale and q . zero (of vector t, into lane (g, t)).
    if (wi == 0) {
#pragma unroll
      for (int s = 0; s < NSUB; ++s) {
        float qp[HALF][4];
        float amax = 0.f, qz = 0.f;
#pragma unroll
        for (int i = 0; i < HALF; ++i) {
          // Register i's four channels: their key scale and zero (fp16 in the slot), and q.
          const int c0 = KMap::key_channel(half * HALF + i, 0, t);
          const uint2 sw = *reinterpret_cast<const uint2*>(kp + c0), zw = *reinterpret_cast<const uint2*>(kp + D + c0);
          const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sw.x));
          const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sw.y));
          const float2 z01 = __half22float2(*reinterpret_cast<const __half2*>(&zw.x));
          const float2 z23 = __half22float2(*reinterpret_cast<const __half2*>(&zw.y));
          const float ksc[4] = {s01.x, s01.y, s23.x, s23.y}, kzr[4] = {z01.x, z01.y, z23.x, z23.y};
          const float4 q4 = qvs[(s * HALF + i) * 32 + lane];
          const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            qp[i][e] = qv[e] * ksc[e];
            amax = fmaxf(amax, fabsf(qp[i][e]));
            qz = fmaf(qv[e], kzr[e], qz);
          }
        }
        amax = max_over(amax, 1, 8);  // the 4 t lanes and the other half: the whole vector
        qz = sum_over(qz, 1, 8);
        const float inv = amax > 0.f ? kOperandRange / amax : 0.f;
#pragma unroll
        for (int i = 0; i < HALF; ++i) {
          std::uint32_t lw, mw, hw;
          pack_digits3(biased_digits3(qp[i][0], inv), biased_digits3(qp[i][1], inv), biased_digits3(qp[i][2], inv),
                       biased_digits3(qp[i][3], inv), lw, mw, hw);
          const std::uint32_t mine = half ? mw : hw, other = half ? hw : mw;
          const std::uint32_t recv = __shfl_xor_sync(0xffffffffu, other, 4);
          const std::uint32_t recv_lo = __shfl_xor_sync(0xffffffffu, lw, 4);
          bq[s][i] = half ? recv : mine;
          bq[s][HALF + i] = half ? mine : recv;
          bl[s][i] = half ? recv_lo : lw;
          bl[s][HALF + i] = half ? lw : recv_lo;
        }
        qscale[s] = __shfl_sync(0xffffffffu, amax / kOperandRange, 8 * t);  // lanes g = 2t built vector t
        bias[s] = __shfl_sync(0xffffffffu, qz, 8 * t);
      }
    }

    // 2. Scores of tokens 16 mt + g (+ 8): keys as the A operand, q' columns as B.
    float sc[NSUB][2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      std::uint32_t w0[KW], w1[KW];
      load_words<KW>(kc + (16 * mt + g) * KRB + t * (KRB / 4), w0);
      load_words<KW>(kc + (16 * mt + g + 8) * KRB + t * (KRB / 4), w1);
      int c[NSUB][4], cl[NSUB][4];
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const std::uint32_t a0 = KMap::key_reg(w0, 2 * ks), a1 = KMap::key_reg(w1, 2 * ks);
        const std::uint32_t a2 = KMap::key_reg(w0, 2 * ks + 1), a3 = KMap::key_reg(w1, 2 * ks + 1);
#pragma unroll
        for (int s = 0; s < NSUB; ++s) {
          if (ks == 0) {
            imma16832_from(c[s], a0, a1, a2, a3, bq[s][0], bq[s][1], kSumBias);
            imma16832_from(cl[s], a0, a1, a2, a3, bl[s][0], bl[s][1], kSumBias);
          } else {
            imma16832(c[s], a0, a1, a2, a3, bq[s][2 * ks], bq[s][2 * ks + 1]);
            imma16832(cl[s], a0, a1, a2, a3, bl[s][2 * ks], bl[s][2 * ks + 1]);
          }
        }
      }
      // c: (token, column 2t) = high, (token, 2t + 1) = middle sums of vector t; cl: low sums (twice).
#pragma unroll
      for (int s = 0; s < NSUB; ++s) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const float sum = fmaf(sum_of(c[s][2 * rh]), 65536.f, fmaf(sum_of(c[s][2 * rh + 1]), 256.f, sum_of(cl[s][2 * rh])));
          sc[s][mt][rh] = fmaf(sum, qscale[s], bias[s]);
        }
      }
    }

    // 3. Online softmax of vector t over the group; P's three digits per vector into pbuf.
    const long long row0 = rows.row_offset + static_cast<long long>(u) * kGroupRows;
    const std::int64_t* upos = rows.pos + bh * rows.pos_head_stride + static_cast<long long>(u) * kGroupRows;
    const std::int64_t newest = *reinterpret_cast<const std::int64_t*>(buf + Shape::POS_OFFSET);
    float psum[NSUB], pq[NSUB];
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
      // Causal by true position: the group's rows are checked one by one only when its newest is
      // after the query (one branch per group, not per row).
      bool keep[2][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) keep[mt][rh] = valid[s] && row0 + 16 * mt + g + 8 * rh < seq_limit;
      }
      if (newest > qpos[s]) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) keep[mt][rh] = keep[mt][rh] && upos[16 * mt + g + 8 * rh] <= qpos[s];
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          sc[s][mt][rh] = keep[mt][rh] ? sc[s][mt][rh] : -INFINITY;
          mx = fmaxf(mx, sc[s][mt][rh]);
        }
      }
      if (a.logits && valid[s]) {
        const long long vec = static_cast<long long>(tile) * kTileRows + 4 * s + t;  // (recomputed: no register held)
        float* dst = a.logits + (static_cast<long long>(bh) * SG + vec) * a.rows_total + row0 + g;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) dst[16 * mt + 8 * rh] = sc[s][mt][rh];
        }
      }
      mx = max_over(mx, 4, 32);  // the 8 g lanes of vector t
      const float m_new = fmaxf(m_run[s], mx);
      const float msub = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2_sfu(m_run[s] - msub);
      const bool rescale = m_run[s] != -INFINITY && alpha != 1.f;  // else acc holds zeros or stays
      float ps = 0.f;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          sc[s][mt][rh] = exp2_sfu(sc[s][mt][rh] - msub);
          ps += sc[s][mt][rh];
        }
      }
      ps = sum_over(ps, 4, 32);
      l_run[s] = l_run[s] * alpha + ps;
      m_run[s] = m_new;
      psum[s] = ps;
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int i = 0; i < NC; ++i) acc[s][i] *= alpha;
        if constexpr (GROUPED) {
#pragma unroll
          for (int i = 0; i < NC; ++i) vsum[s][i] *= alpha;
          psum_g[s] *= alpha;
        }
      }
      const float pmax = mx == -INFINITY ? 0.f : exp2_sfu(mx - msub);
      const float pinv = pmax > 0.f ? kOperandRange / pmax : 0.f;
      pq[s] = pmax / kOperandRange;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const int tok = 16 * mt + g + 8 * rh;
          const std::uint32_t u = biased_digits3(sc[s][mt][rh], pinv);  // bytes: lo, mid, hi (+ 128)
          unsigned char* col = pbuf + (s * 4 + t) * 3 * kGroupRows + tok;
          col[0] = static_cast<unsigned char>(u >> 16);
          col[kGroupRows] = static_cast<unsigned char>(u >> 8);
          col[2 * kGroupRows] = static_cast<unsigned char>(u);
        }
      }
    }
    __syncwarp();

    // 4. Values: the codes of tokens 4t.. and 16+4t.. transposed into A (rows = channels), P as B.
    std::uint32_t pb[NSUB][2], pl[NSUB][2];  // column g: high (g even) / middle digits; low digits
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
      const unsigned char* vcols = pbuf + (s * 4 + g / 2) * 3 * kGroupRows;
      const unsigned char* col = vcols + half * kGroupRows;
      const unsigned char* low = vcols + 2 * kGroupRows;
      pb[s][0] = *reinterpret_cast<const std::uint32_t*>(col + 4 * t) ^ 0x80808080u;  // biased -> s8
      pb[s][1] = *reinterpret_cast<const std::uint32_t*>(col + 16 + 4 * t) ^ 0x80808080u;
      pl[s][0] = *reinterpret_cast<const std::uint32_t*>(low + 4 * t) ^ 0x80808080u;
      pl[s][1] = *reinterpret_cast<const std::uint32_t*>(low + 16 + 4 * t) ^ 0x80808080u;
    }
    std::uint32_t x[2][4 * NWV];
#pragma unroll
    for (int quad = 0; quad < 2; ++quad) {
      const unsigned char* tokp = vc + (16 * quad + 4 * t) * VRB + g * BPLV;
      std::uint32_t w[4][NWV];  // the lane's share of each of the quad's 4 tokens
      load_quad_rows<BPLV, NWV, VRB>(tokp, w);
#pragma unroll
      for (int word = 0; word < NWV; ++word) {
        gather_quad(w[0][word], w[1][word], w[2][word], w[3][word], BPLV >= 4 ? 4 : BPLV, x[quad] + 4 * word);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const std::uint32_t a0 = VMap::value_reg(x[0], 2 * mt), a1 = VMap::value_reg(x[0], 2 * mt + 1);
      const std::uint32_t a2 = VMap::value_reg(x[1], 2 * mt), a3 = VMap::value_reg(x[1], 2 * mt + 1);
      const int ch = VMap::value_channel(2 * mt, g);  // and ch + 1 (the next byte of the same plane)
#pragma unroll
      for (int s = 0; s < NSUB; ++s) {
        int c[4], cl[4];
        imma16832_from(c, a0, a1, a2, a3, pb[s][0], pb[s][1], kSumBias);
        imma16832_from(cl, a0, a1, a2, a3, pl[s][0], pl[s][1], kSumBias);
        const float f0 = fmaf(sum_of(c[0]), 65536.f, fmaf(sum_of(c[1]), 256.f, sum_of(cl[0])));
        const float f1 = fmaf(sum_of(c[2]), 65536.f, fmaf(sum_of(c[3]), 256.f, sum_of(cl[2])));
        if constexpr (GROUPED) {
          vsum[s][2 * mt] = fmaf(f0, pq[s], vsum[s][2 * mt]);
          vsum[s][2 * mt + 1] = fmaf(f1, pq[s], vsum[s][2 * mt + 1]);
        } else {
          const float2 vs = __half22float2(*reinterpret_cast<const __half2*>(vp + ch));
          const float2 vz = __half22float2(*reinterpret_cast<const __half2*>(vp + D + ch));
          acc[s][2 * mt] = fmaf(f0 * pq[s], vs.x, fmaf(vz.x, psum[s], acc[s][2 * mt]));
          acc[s][2 * mt + 1] = fmaf(f1 * pq[s], vs.y, fmaf(vz.y, psum[s], acc[s][2 * mt + 1]));
        }
      }
    }
    if constexpr (GROUPED) {
#pragma unroll
      for (int s = 0; s < NSUB; ++s) psum_g[s] += psum[s];
      if (last_of_group) {  // the group's scale and zero, once
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int ch = VMap::value_channel(2 * mt, g);
          const float2 vs = __half22float2(*reinterpret_cast<const __half2*>(vp + ch));
          const float2 vz = __half22float2(*reinterpret_cast<const __half2*>(vp + D + ch));
#pragma unroll
          for (int s = 0; s < NSUB; ++s) {
            acc[s][2 * mt] = fmaf(vsum[s][2 * mt], vs.x, fmaf(vz.x, psum_g[s], acc[s][2 * mt]));
            acc[s][2 * mt + 1] = fmaf(vsum[s][2 * mt + 1], vs.y, fmaf(vz.y, psum_g[s], acc[s][2 * mt + 1]));
            vsum[s][2 * mt] = vsum[s][2 * mt + 1] = 0.f;
          }
        }
#pragma unroll
        for (int s = 0; s < NSUB; ++s) psum_g[s] = 0.f;
      }
    }
    __syncwarp();  // pbuf and this stage are written again next
    gi = next_gi;
    wi = next_wi;
  }
  cp_async_wait<0>();

  __syncthreads();  // every warp is done with its stages: the memory becomes the merge scratch
  float* red = reinterpret_cast<float*>(smem);
  float* red_ml = red + kWarps * kTileRows * D;
#pragma unroll
  for (int s = 0; s < NSUB; ++s) {
    const int row = 4 * s + t;
#pragma unroll
    for (int i = 0; i < NC; ++i) red[(warp * kTileRows + row) * D + VMap::value_channel(i, g)] = acc[s][i];
    if (g == 0) {
      red_ml[(warp * kTileRows + row) * 2] = m_run[s];
      red_ml[(warp * kTileRows + row) * 2 + 1] = l_run[s];
    }
  }
  __syncthreads();
  merge_warps<D>(a, tile, bh, red, parts, part_base + blockIdx.x);
  pdl_wait();  // launched early after another codes segment (part_base > 0): finish after it
}

template <int KB, int VB, int D, int NSUB, bool GROUPED>
int codes_resident() {
  static const int n = [] {
    constexpr int smem = CodeShape<KB, VB, D, NSUB>::SMEM;
    set_smem_always(attend_codes_kernel<KB, VB, D, NSUB, GROUPED>, smem);
    return resident_ctas(attend_codes_kernel<KB, VB, D, NSUB, GROUPED>, smem);
  }();
  return n;
}

// Units per split: whole groups.
int split_units(const PackedRows& rows, int splits) {
  if (splits <= 0) return 0;
  const int groups = rows.n_units / rows.group_units;
  return (groups + splits - 1) / splits * rows.group_units;
}

template <int KB, int VB, int D, int NSUB, bool GROUPED>
void codes_launch(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                  cudaStream_t stream) {
  constexpr int smem = CodeShape<KB, VB, D, NSUB>::SMEM;
  auto kernel = attend_codes_kernel<KB, VB, D, NSUB, GROUPED>;
  static std::atomic<unsigned long long> done{0};
  set_smem(kernel, smem, done);
  launch_kernel(splits > 0, part_base > 0, kernel, dim3(splits, q.tiles(), q.B * q.Hkv), dim3(kThreads), smem, stream, q, rows,
                parts, part_base, split_units(rows, splits));
}

// f<KB, VB, D, NSUB, GROUPED>() for the kernel that reads `rows` for `q`: the widths (2, 4 or 8
// each), head_dim 64 / 128, one sub-tile when a step's query vectors fit in 4 (decode with up to 4
// query heads per KV head), groups of one unit or more.
template <typename F>
void with_kernel(const QueryArgs& q, const PackedRows& rows, F&& f) {
  if (!supported_head_dim(q.D)) throw InputError("cuda attend: no kernel for head_dim " + std::to_string(q.D) + " (64/128)");
  if (rows.group_units < 1 || rows.n_units % rows.group_units != 0) {
    throw InputError("cuda attend: " + std::to_string(rows.n_units) + " units of 32 rows are not whole groups of " +
                     std::to_string(rows.group_units));
  }
  const bool one = static_cast<long long>(q.S) * q.G <= 4, grouped = rows.group_units > 1;
  auto shape = [&]<int KB, int VB>() {
    auto pick = [&]<int D>() {
      if (one) {
        grouped ? f.template operator()<KB, VB, D, 1, true>() : f.template operator()<KB, VB, D, 1, false>();
      } else {
        grouped ? f.template operator()<KB, VB, D, 2, true>() : f.template operator()<KB, VB, D, 2, false>();
      }
    };
    q.D == 64 ? pick.template operator()<64>() : pick.template operator()<128>();
  };
  auto values = [&]<int KB>() {
    switch (rows.v_bits) {
      case 2: return shape.template operator()<KB, 2>();
      case 4: return shape.template operator()<KB, 4>();
      case 8: return shape.template operator()<KB, 8>();
    }
    throw InputError("cuda attend: no kernel for " + std::to_string(rows.v_bits) + "-bit value codes (2/4/8)");
  };
  switch (rows.k_bits) {
    case 2: return values.template operator()<2>();
    case 4: return values.template operator()<4>();
    case 8: return values.template operator()<8>();
  }
  throw InputError("cuda attend: no kernel for " + std::to_string(rows.k_bits) + "-bit key codes (2/4/8)");
}

// A decode step (<= 4 query vectors per KV head) over groups of 2+ units runs the fp16 kernel
// (attend_codes_half.cu), everything else the int8 kernel above. KVSLIM_CUDA_DECODE_CODES=int8 keeps
// decode on the int8 kernel: the benchmark's and the tests' comparison of the two, read once per
// process.
bool decode_on_half(const QueryArgs& q, const PackedRows& rows) {
  static const bool int8_only = [] {
    const char* v = std::getenv("KVSLIM_CUDA_DECODE_CODES");
    if (v == nullptr || std::string(v).empty() || std::string(v) == "fp16") return false;
    if (std::string(v) == "int8") return true;
    throw InputError(std::string("KVSLIM_CUDA_DECODE_CODES: '") + v + "' is not a kernel (fp16 or int8)");
  }();
  return !int8_only && half_codes_take(q, rows);
}

}  // namespace

namespace {
int packed_resident(const QueryArgs& q, const PackedRows& rows) {
  int resident = 2;
  with_kernel(q, rows, [&]<int KB, int VB, int D, int NSUB, bool GROUPED>() {
    resident = decode_on_half(q, rows) ? half_codes_resident(q, rows) : codes_resident<KB, VB, D, NSUB, GROUPED>();
  });
  return resident;
}
// The units splits_for counts: at least two a warp (one group a warp when a group has two or more).
int split_work(const PackedRows& rows) {
  return rows.group_units >= 2 ? 2 * (rows.n_units / rows.group_units) : rows.n_units;
}
}  // namespace

int packed_splits(const QueryArgs& q, const PackedRows& rows, int sm_count) {
  return splits_for(q, split_work(rows), sm_count, packed_resident(q, rows));
}

std::pair<int, int> packed_splits_side_by_side(const QueryArgs& q, const PackedRows& a, const PackedRows& b,
                                               int sm_count) {
  const int ua = a.n_units > 0 ? split_work(a) : 0, ub = b.n_units > 0 ? split_work(b) : 0;
  if (ua <= 0 || ub <= 0) return {ua > 0 ? packed_splits(q, a, sm_count) : 0, ub > 0 ? packed_splits(q, b, sm_count) : 0};
  const int resident = std::min(packed_resident(q, a), packed_resident(q, b));
  const int total = splits_for(q, ua + ub, sm_count, resident);
  const int most_a = splits_for(q, ua, sm_count, resident), most_b = splits_for(q, ub, sm_count, resident);
  const long long share = (static_cast<long long>(total) * ua + (ua + ub) / 2) / (ua + ub);
  const int sa = std::clamp(static_cast<int>(share), 1, std::max(1, std::min(most_a, total - 1)));
  return {sa, std::clamp(total - sa, 1, most_b)};
}

void launch_packed(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                   cudaStream_t stream) {
  splits = std::max(splits, 0);
  with_kernel(q, rows, [&]<int KB, int VB, int D, int NSUB, bool GROUPED>() {
    if (decode_on_half(q, rows)) {
      launch_half_codes(q, rows, parts, part_base, splits, split_units(rows, splits), stream);
    } else {
      codes_launch<KB, VB, D, NSUB, GROUPED>(q, rows, parts, part_base, splits, stream);
    }
  });
}

}  // namespace kvslim::cuda
