// Split-K decode/prefill attention over dense fp16/bf16 rows (full's slots, kivi's staging window),
// the merge of every split's partial (combine) and the probabilities of an observation. The kivi
// codes have their own kernel (attend_codes.cu); attend.h has the contract, cuda_common.cuh the mma
// fragment layout these kernels lean on.
//
// Each CTA = 4 warps takes a range of 16-row units of one (tile, b, h); each warp streams its units
// global -> shared through cp.async (3 stages), computes S^T = Q K^T with the query tile as the mma's
// A operand (rows g = high parts, g + 8 = low parts of the same query vectors, so one lane ends up
// with both halves of its logits), runs the online softmax in registers, and multiplies P (split in
// high/low 16-bit parts again) with V. The warps merge in shared memory and the CTA writes one
// partial; launch_combine merges the splits.
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <string>

#include "cuda/attend.h"
#include "cuda/attend_shared.cuh"
#include "cuda/env_switch.h"
#include "cuda/fragment_maps.h"
#include "cuda/row_probability.cuh"
#include "cuda/step_graph.h"

namespace kvslim::cuda {
namespace {

using namespace attend_detail;
// Units in flight per warp (the one being read and kStages - 1 loading). KVSLIM_DENSE_STAGES: a build
// for A/B runs (2 stages fit 3 CTAs an SM at D 128, 3 fit 2).
#ifndef KVSLIM_DENSE_STAGES
#define KVSLIM_DENSE_STAGES 3
#endif
constexpr int kStages = KVSLIM_DENSE_STAGES;
static_assert(kStages >= 2, "a unit loads while another is read");
constexpr int kUnit = 16;  // dense rows per unit (a warp's step)
// A dense stage: the unit's key rows, value rows, then their positions (int64), so that the causal
// check and the unit's newest position come from shared memory, not a dependent global load.
template <int D>
__host__ __device__ constexpr int dense_stage_bytes() { return 2 * kUnit * D * 2 + kUnit * 8; }
constexpr float kPScale = 16384.f;  // P * 2^14 before the 16-bit split: small weights stay normal
constexpr float kPUnscale = 1.f / 16384.f;

__device__ __forceinline__ std::uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---------------------------------------------------------------------------------------------
// The dense kernel's view of its tile: lane row g = query vector tile * 8 + g.

struct TileRows {
  int b, h, bh, tile, g, t, lane, warp;
  long long m_index;      // query vector of this lane's row (s * G + j)
  bool valid;             // m_index < S * G
  std::int64_t qpos;      // its position (INT64_MIN when not valid: sees nothing)
};

__device__ TileRows tile_rows(const QueryArgs& a) {
  TileRows r;
  r.tile = blockIdx.y;
  r.bh = blockIdx.z;
  r.b = r.bh / a.Hkv;
  r.h = r.bh % a.Hkv;
  r.lane = threadIdx.x % 32;
  r.warp = threadIdx.x / 32;
  r.g = r.lane / 4;
  r.t = r.lane % 4;
  r.m_index = static_cast<long long>(r.tile) * kTileRows + r.g;
  r.valid = r.m_index < static_cast<long long>(a.S) * a.G;
  const long long s = r.m_index / a.G;
  r.qpos = !r.valid ? INT64_MIN : a.qpos ? a.qpos[s] : a.qpos_inline[s];
  return r;
}

// Online softmax state of a lane's row, and its accumulators: channel value_channel(nt, 2t + e).
template <int D>
struct RowState {
  float m = -INFINITY, l = 0.f;
  float acc[D / 8][2];
  __device__ RowState() {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = 0.f;
  }
};

// Masks, records and exponentiates NT n-tiles of scores s[NT][2] (tokens nt*8 + 2t + e of the unit,
// cache rows row0 + ...); returns the unit's row sum of probabilities (every lane of the quad).
template <int D, int NT>
__device__ float softmax_unit(const QueryArgs& a, const TileRows& r, RowState<D>& st, float (&s)[NT][2],
                              long long row0, int n_valid, const std::int64_t* pos, std::int64_t newest) {
  const bool check_pos = newest > r.qpos;
  const int seq_limit = a.seq_rows ? a.seq_rows[r.b] : INT32_MAX;
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = nt * 8 + 2 * r.t + e;
      const long long row = row0 + tok;
      bool keep = tok < n_valid && row < seq_limit;
      if (keep && check_pos) keep = pos[tok] <= r.qpos;
      if (!r.valid) keep = false;
      s[nt][e] = keep ? s[nt][e] : -INFINITY;
      if (a.logits && r.valid && tok < n_valid) {
        a.logits[(static_cast<long long>(r.bh) * a.S * a.G + r.m_index) * a.rows_total + row] = s[nt][e];
      }
      mx = fmaxf(mx, s[nt][e]);
    }
  }
  mx = warp_max4(mx);
  const float m_old = st.m;
  const float m_new = fmaxf(m_old, mx);
  const float msub = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f(st.m - msub);
  float psum = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[nt][e] = exp2f(s[nt][e] - msub);
      psum += s[nt][e];
    }
  }
  psum = warp_sum4(psum);
  st.l = st.l * alpha + psum;
  st.m = m_new;
  // Most units leave every row's max where it was (rows without any score yet hold zeros).
  if (__any_sync(0xffffffffu, m_old != -INFINITY && alpha != 1.f)) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      st.acc[i][0] *= alpha;
      st.acc[i][1] *= alpha;
    }
  }
  return psum;
}

// Warps -> one partial of the CTA. red: shared scratch of kWarps * 8 * (D + 2) floats.
template <int D, typename Map>
__device__ void write_partial(const QueryArgs& a, const TileRows& r, const RowState<D>& st, float* red,
                              const Partials& parts, int part) {
  float* red_acc = red;                          // [warps][8][D]
  float* red_ml = red + kWarps * kTileRows * D;  // [warps][8][2]
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      red_acc[(r.warp * kTileRows + r.g) * D + Map::value_channel(nt, 2 * r.t + e)] = st.acc[nt][e];
    }
  }
  if (r.t == 0) {
    red_ml[(r.warp * kTileRows + r.g) * 2] = st.m;
    red_ml[(r.warp * kTileRows + r.g) * 2 + 1] = st.l;
  }
  __syncthreads();
  merge_warps<D>(a, r.tile, r.bh, red, parts, part);
}

// ---------------------------------------------------------------------------------------------
// Dense fp16 / bf16 rows, 16 rows a unit.

template <DenseType T, int D>
__global__ void __launch_bounds__(kThreads) attend_dense_kernel(QueryArgs a, DenseRows rows, Partials parts,
                                                                 int part_base, int units_per_split) {
  using Map = DenseMap<D>;
  constexpr int UNIT = kUnit;
  constexpr int KS = D / 16;
  constexpr int ROW_BYTES = D * 2;
  constexpr int STAGE = dense_stage_bytes<D>();
  constexpr int POS_OFFSET = 2 * UNIT * ROW_BYTES;
  extern __shared__ __align__(16) unsigned char smem[];
  float* q_s = reinterpret_cast<float*>(smem);
  unsigned char* stages = smem + kTileRows * D * sizeof(float);

  pdl_launch_dependents();  // the merge may launch; it waits for this kernel before reading
  const TileRows r = tile_rows(a);

  const int n_units = (rows.n_rows + UNIT - 1) / UNIT;
  const int u_begin = blockIdx.x * units_per_split;
  const int u_end = min(n_units, u_begin + units_per_split);
  unsigned char* my = stages + r.warp * kStages * STAGE;
  const unsigned char* k_head = reinterpret_cast<const unsigned char*>(rows.k + r.bh * rows.head_stride);
  const unsigned char* v_head = reinterpret_cast<const unsigned char*>(rows.v + r.bh * rows.head_stride);

  auto issue = [&](int u, int stage) {
    unsigned char* dst = my + stage * STAGE;
    const long long src0 = static_cast<long long>(u) * UNIT * ROW_BYTES;
#pragma unroll
    for (int i = r.lane; i < UNIT * ROW_BYTES / 16; i += 32) {
      cp_async16(dst + 16 * i, k_head + src0 + 16 * i);
      cp_async16(dst + UNIT * ROW_BYTES + 16 * i, v_head + src0 + 16 * i);
    }
    const long long row = static_cast<long long>(u) * UNIT + r.lane;
    cp_async8_if(r.lane < UNIT && row < rows.n_rows, dst + POS_OFFSET + 8 * r.lane,
                 rows.pos + r.bh * rows.pos_head_stride + row);
  };

  // The first units' copies before the queries' loads, so that their latencies overlap (a batch-1
  // call, a few units a warp, waits for both); the stages and q_s do not overlap.
  const int first = u_begin + r.warp;
  const int n_mine = first < u_end ? (u_end - first + kWarps - 1) / kWarps : 0;
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < n_mine) issue(first + k * kWarps, k);
    cp_async_commit();
  }
  load_tile_queries<kTileRows, D>(a, r.tile, r.b, r.h, q_s);  // q_s [8][D]
  __syncthreads();

  // Query fragments once: (hi, lo) of q scaled by a power of two per row.
  std::uint32_t af[KS][4];
  float up;
  {
    float amax = 0.f;
#pragma unroll
    for (int p = 0; p < D / 8; ++p) {
      amax = fmaxf(amax, fabsf(q_s[r.g * D + Map::key_channel(p, 0, r.t)]));
      amax = fmaxf(amax, fabsf(q_s[r.g * D + Map::key_channel(p, 1, r.t)]));
    }
    amax = warp_max4(amax);
    int ex = amax > 0.f ? ((__float_as_int(amax) >> 23) & 0xff) - 127 - 14 : 0;
    ex = max(-100, min(100, ex));
    const float down = pow2i(-ex);
    up = pow2i(ex);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int p0 = 2 * ks, p1 = 2 * ks + 1;
      split2<T>(q_s[r.g * D + Map::key_channel(p0, 0, r.t)] * down, q_s[r.g * D + Map::key_channel(p0, 1, r.t)] * down,
                af[ks][0], af[ks][1]);
      split2<T>(q_s[r.g * D + Map::key_channel(p1, 0, r.t)] * down, q_s[r.g * D + Map::key_channel(p1, 1, r.t)] * down,
                af[ks][2], af[ks][3]);
    }
  }

  RowState<D> st;
  for (int k = 0; k < n_mine; ++k) {
    const int ahead = k + kStages - 1;
    if (ahead < n_mine) issue(first + ahead * kWarps, ahead % kStages);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const int u = first + k * kWarps;
    const unsigned char* kb = my + (k % kStages) * STAGE;
    const unsigned char* vb = kb + UNIT * ROW_BYTES;

    float s[2][2];
    {
      float c[2][4] = {};
#pragma unroll
      for (int ch = 0; ch < D / 32; ++ch) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint4 w = *reinterpret_cast<const uint4*>(kb + (nt * 8 + r.g) * ROW_BYTES + (4 * ch + r.t) * 16);
          mma16816<T>(c[nt], af[2 * ch], w.x, w.y);
          mma16816<T>(c[nt], af[2 * ch + 1], w.z, w.w);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        s[nt][0] = (c[nt][0] + c[nt][2]) * up;
        s[nt][1] = (c[nt][1] + c[nt][3]) * up;
      }
    }
    const int n_valid = min(UNIT, rows.n_rows - u * UNIT);
    const std::int64_t* upos = reinterpret_cast<const std::int64_t*>(kb + POS_OFFSET);
    softmax_unit<D, 2>(a, r, st, s, rows.row_offset + static_cast<long long>(u) * UNIT, n_valid, upos,
                       rows.unordered ? INT64_MAX : upos[n_valid - 1]);

    std::uint32_t pf[4];
    split2<T>(s[0][0] * kPScale, s[0][1] * kPScale, pf[0], pf[1]);
    split2<T>(s[1][0] * kPScale, s[1][1] * kPScale, pf[2], pf[3]);
    // Tokens {2t, 2t+1, 2t+8, 2t+9}, chunks g + 8c.
#pragma unroll
    for (int c8 = 0; c8 < D / 64; ++c8) {
      uint4 vt[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int tok = 2 * r.t + (q & 1) + (q >> 1) * 8;
        vt[q] = *reinterpret_cast<const uint4*>(vb + tok * ROW_BYTES + (r.g + 8 * c8) * 16);
      }
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::uint32_t sel = e ? 0x7632u : 0x5410u;
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          mma16816<T>(c, pf, prmt(word(vt[0], wi), word(vt[1], wi), sel), prmt(word(vt[2], wi), word(vt[3], wi), sel));
          const int nt = (c8 * 4 + wi) * 2 + e;
          st.acc[nt][0] += (c[0] + c[2]) * kPUnscale;
          st.acc[nt][1] += (c[1] + c[3]) * kPUnscale;
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  write_partial<D, Map>(a, r, st, reinterpret_cast<float*>(stages), parts, part_base + blockIdx.x);
  pdl_wait();  // launched early after the codes kernel: finish after it (the merge waits for this one)
}

// ---------------------------------------------------------------------------------------------

// One CTA of kCombineWarps warps per (tile row, tile, b * h): warp w merges splits w, w + 8, ...
// into all D channels (lane: D / 32 consecutive channels, one vector load per split; every warp
// finds the largest split max itself), then the warps' sums meet in shared memory. A warp issues
// the loads of its first kCombinePrefetch splits together with those of the max pass, so up to
// 8 * kCombinePrefetch splits (batch 1: 49-70) cost one memory latency, not three.
constexpr int kCombinePrefetch = 8;

template <int D>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(QueryArgs a, Partials parts, int n_parts,
                                                                      float* out, float* final_ml) {
  constexpr int CPL = D / 32;  // channels per lane
  static_assert(CPL == 2 || CPL == 4, "head_dim 64 or 128");
  __shared__ float red[kCombineWarps][D];
  __shared__ float red_l[kCombineWarps];
  const long long tiles = a.tiles(), BH = static_cast<long long>(a.B) * a.Hkv;
  const int row = blockIdx.x % kTileRows;
  const int tile = static_cast<int>((blockIdx.x / kTileRows) % tiles);
  const long long bh = blockIdx.x / kTileRows / tiles;
  const long long m = static_cast<long long>(tile) * kTileRows + row;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  pdl_wait();  // the partials of the kernels before
  pdl_launch_dependents();  // a decode step's observation may launch; it waits for this merge before reading it
  if (m >= static_cast<long long>(a.S) * a.G) return;  // the whole CTA
  const auto slot = [&](int p) { return ((static_cast<long long>(p) * tiles + tile) * BH + bh) * kTileRows + row; };
  // The warp's first splits, loaded before the max is known: v_pre [kCombinePrefetch][CPL] channels,
  // ml_pre [kCombinePrefetch] (max, sum) of splits warp + kCombineWarps * k.
  float v_pre[kCombinePrefetch][CPL];
  float2 ml_pre[kCombinePrefetch];
#pragma unroll
  for (int k = 0; k < kCombinePrefetch; ++k) {
    const int p = warp + kCombineWarps * k;
    ml_pre[k] = make_float2(-INFINITY, 0.f);
#pragma unroll
    for (int i = 0; i < CPL; ++i) v_pre[k][i] = 0.f;
    if (p < n_parts) {
      ml_pre[k] = *reinterpret_cast<const float2*>(parts.ml + slot(p) * 2);
      load_split<CPL>(v_pre[k], parts.acc + slot(p) * D + lane * CPL);
    }
  }
  float M = -INFINITY;
  for (int p = lane; p < n_parts; p += 32) M = fmaxf(M, parts.ml[slot(p) * 2]);
  M = max_over(M, 1, 32);
  float acc[CPL], L = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) acc[i] = 0.f;
  if (M != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kCombinePrefetch; ++k) {
      if (warp + kCombineWarps * k >= n_parts) break;
      const float f = ml_pre[k].x == -INFINITY ? 0.f : exp2f(ml_pre[k].x - M);
      L = fmaf(f, ml_pre[k].y, L);
      add_split<CPL>(acc, f, v_pre[k]);
    }
#pragma unroll 4
    for (int p = warp + kCombineWarps * kCombinePrefetch; p < n_parts; p += kCombineWarps) {
      const float mp = parts.ml[slot(p) * 2], lp = parts.ml[slot(p) * 2 + 1];
      const float f = mp == -INFINITY ? 0.f : exp2f(mp - M);
      L = fmaf(f, lp, L);
      float v[CPL];
      load_split<CPL>(v, parts.acc + slot(p) * D + lane * CPL);
      add_split<CPL>(acc, f, v);
    }
  }
#pragma unroll
  for (int i = 0; i < CPL; ++i) red[warp][lane * CPL + i] = acc[i];
  if (lane == 0) red_l[warp] = L;
  __syncthreads();
  float total_l = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) total_l += red_l[w];
  const long long s = m / a.G, j = m % a.G;
  const long long b = bh / a.Hkv, h = bh % a.Hkv;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float A = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) A += red[w][c];
    out[((b * a.S + s) * a.Hq + h * a.G + j) * D + c] = total_l > 0.f ? A / total_l : 0.f;
  }
  if (threadIdx.x == 0 && final_ml) {
    final_ml[(bh * a.S * a.G + m) * 2] = M;
    final_ml[(bh * a.S * a.G + m) * 2 + 1] = total_l;
  }
}

__global__ void probs_kernel(QueryArgs a, const float* final_ml, float* probs) {
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= a.rows_total) return;
  const long long n_bhs = static_cast<long long>(a.B) * a.Hkv * a.S;
  for (long long bhs = blockIdx.y; bhs < n_bhs; bhs += gridDim.y) {  // (b * Hkv + h) * S + s
    probs[bhs * a.rows_total + row] = summed_probability(a.logits, final_ml, bhs * a.G, a.G, a.rows_total, row);
  }
}

template <int D>
int dense_smem() {
  return kTileRows * D * 4 + std::max(kWarps * kStages * dense_stage_bytes<D>(), kWarps * kTileRows * (D + 2) * 4);
}
template <DenseType T, int D>
int dense_resident() {
  static const int n = [] {
    set_smem_always(attend_dense_kernel<T, D>, dense_smem<D>());
    return resident_ctas(attend_dense_kernel<T, D>, dense_smem<D>());
  }();
  return n;
}

template <DenseType T, int D>
void dense_launch(const QueryArgs& q, const DenseRows& rows, const Partials& parts, int part_base, int splits,
                  cudaStream_t stream) {
  const int smem = dense_smem<D>();
  auto kernel = attend_dense_kernel<T, D>;
  static std::atomic<unsigned long long> done{0};
  set_smem(kernel, smem, done);
  const int units = (rows.n_rows + kUnit - 1) / kUnit;
  const int per = splits > 0 ? (units + splits - 1) / splits : 0;
  launch_kernel(splits > 0, part_base > 0, kernel, dim3(splits, q.tiles(), q.B * q.Hkv), dim3(kThreads),
                static_cast<std::size_t>(smem), stream, q, rows, parts, part_base, per);
}

}  // namespace

int dense_splits(const QueryArgs& q, int n_rows, int sm_count, DenseType type) {
  int resident = 2;
  const bool bf = type == DenseType::bf16;
  if (q.D == 64) resident = bf ? dense_resident<DenseType::bf16, 64>() : dense_resident<DenseType::f16, 64>();
  if (q.D == 128) resident = bf ? dense_resident<DenseType::bf16, 128>() : dense_resident<DenseType::f16, 128>();
  return splits_for(q, (n_rows + 15) / 16, sm_count, resident);
}

int launch_codes_and_window(const QueryArgs& q, const PackedRows& codes, const DenseRows& window,
                            const Partials& parts, bool count_only, int sm_count, cudaStream_t stream) {
  const int ps = codes.n_units > 0 ? packed_splits(q, codes, sm_count) : 0;
  const int ds = window.n_rows > 0 ? dense_splits(q, window.n_rows, sm_count, window.type) : 0;
  if (!count_only) {
    launch_side_by_side(
        stream, [&](cudaStream_t s) { launch_packed(q, codes, parts, 0, ps, s); },
        [&](cudaStream_t s) { launch_dense(q, window, parts, ps, ds, s); });
  }
  return ps + ds;
}

int launch_sets_and_window(const QueryArgs& q, const PackedRows& hi, const PackedRows& lo, const DenseRows& window,
                           const Partials& parts, bool count_only, int sm_count, cudaStream_t stream) {
  const auto [hs, ls] = packed_splits_side_by_side(q, hi, lo, sm_count);
  const int ds = window.n_rows > 0 ? dense_splits(q, window.n_rows, sm_count, window.type) : 0;
  if (!count_only) {
    launch_side_by_side(
        stream, [&](cudaStream_t s) { launch_packed(q, hi, parts, 0, hs, s); },
        [&](cudaStream_t s) {
          launch_packed(q, lo, parts, hs, ls, s);
          launch_dense(q, window, parts, hs + ls, ds, s);
        });
  }
  return hs + ls + ds;
}

void launch_dense(const QueryArgs& q, const DenseRows& rows, const Partials& parts, int part_base, int splits,
                  cudaStream_t stream) {
  splits = std::max(splits, 0);
  const bool bf = rows.type == DenseType::bf16;
  if (q.D == 64) return bf ? dense_launch<DenseType::bf16, 64>(q, rows, parts, part_base, splits, stream)
                           : dense_launch<DenseType::f16, 64>(q, rows, parts, part_base, splits, stream);
  if (q.D == 128) return bf ? dense_launch<DenseType::bf16, 128>(q, rows, parts, part_base, splits, stream)
                            : dense_launch<DenseType::f16, 128>(q, rows, parts, part_base, splits, stream);
  throw InputError("cuda attend: no kernel for head_dim " + std::to_string(q.D) + " (64 or 128)");
}

namespace {
std::atomic<int> g_fused_merge{-1};  // -1: not read from the environment yet
}  // namespace

bool fused_merge() {
  int v = g_fused_merge.load(std::memory_order_relaxed);
  if (v < 0) {
    int expected = -1;
    g_fused_merge.compare_exchange_strong(expected, env_switch("KVSLIM_CUDA_FUSED_MERGE", false) ? 1 : 0);
    v = g_fused_merge.load(std::memory_order_relaxed);
  }
  return v == 1;
}

void set_fused_merge(bool on) { g_fused_merge.store(on ? 1 : 0, std::memory_order_relaxed); }

void launch_combine(const QueryArgs& q, const Partials& parts, int n_parts, float* out, float* final_ml,
                    cudaStream_t stream) {
  const long long ctas = static_cast<long long>(q.tiles()) * q.B * q.Hkv * kTileRows;
  const dim3 grid(static_cast<unsigned>(ctas)), block(32 * kCombineWarps);
  if (q.D == 64) return launch_kernel(true, true, combine_kernel<64>, grid, block, 0, stream, q, parts, n_parts, out, final_ml);
  if (q.D == 128) return launch_kernel(true, true, combine_kernel<128>, grid, block, 0, stream, q, parts, n_parts, out, final_ml);
  throw InputError("cuda attend: no merge for head_dim " + std::to_string(q.D) + " (64 or 128)");
}

void launch_probs(const QueryArgs& q, const float* final_ml, float* probs, cudaStream_t stream) {
  const long long n_bhs = static_cast<long long>(q.B) * q.Hkv * q.S;
  const dim3 grid(static_cast<unsigned>((q.rows_total + 255) / 256), static_cast<unsigned>(std::min(n_bhs, 65535LL)));
  launch_kernel(q.rows_total > 0, false, probs_kernel, grid, dim3(256), 0, stream, q, final_ml, probs);
}

}  // namespace kvslim::cuda
