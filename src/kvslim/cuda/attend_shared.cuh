// Pieces the attention kernels share (attend.cu: dense rows, combine; attend_codes.cu: kivi codes):
// the CTA shape, the merge of a CTA's warps into one partial, and the launch arithmetic (shared
// memory limits, occupancy, splits).
#pragma once
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <utility>

#include "cuda/attend.h"
#include "cuda/cuda_common.cuh"
#include "cuda/kernel_launch.h"

namespace kvslim::cuda::attend_detail {

constexpr int kWarps = 4;  // a CTA: 4 warps, each streaming its own units of rows
constexpr int kThreads = 32 * kWarps;

// dst [ROWS][D] = the query vectors tile * kTileRows + 0 .. ROWS - 1 of KV head (b, h) times the
// logit scale (log2 units); vectors past S * G are zero. Each thread issues all of its loads before
// it uses the first: rounds of dependent load, multiply, store were the codes kernel's most sampled
// stall (docs/cuda.md, stop 49).
template <int ROWS, int D>
__device__ __forceinline__ void load_tile_queries(const QueryArgs& a, int tile, int b, int h, float* dst) {
  static_assert(ROWS * D % kThreads == 0, "whole rounds of query elements per thread");
  constexpr int kPerThread = ROWS * D / kThreads;
  const long long SG = static_cast<long long>(a.S) * a.G;
  float x[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kThreads, v = i / D, c = i % D;
    const long long m = static_cast<long long>(tile) * kTileRows + v;
    x[k] = 0.f;
    if (m < SG) {
      const long long sq = m / a.G, j = m % a.G;
      x[k] = a.q[((static_cast<long long>(b) * a.S + sq) * a.Hq + static_cast<long long>(h) * a.G + j) * D + c];
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) dst[threadIdx.x + k * kThreads] = x[k] * a.scale_log2;
}

// combine_kernel's warps (attend.cu): warp w merges splits w, w + 8, ..., then the warps' sums
// meet in order. The fused merge (merge_parts) sums in that same order, so both give the same bits.
constexpr int kCombineWarps = 8;

// One split's share of a merge, shared by combine_kernel and merge_parts so that their arithmetic
// cannot drift apart (they must agree to the bit): v = the CPL channels of a split's sums at src
// (past L1 when another CTA of the same kernel wrote them), then acc[i] += f * v[i] in channel order.
template <int CPL, bool kPastL1 = false>
__device__ __forceinline__ void load_split(float (&v)[CPL], const float* src) {
  static_assert(CPL == 2 || CPL == 4, "head_dim 64 or 128");
  if constexpr (CPL == 4) {
    const float4 x = kPastL1 ? __ldcg(reinterpret_cast<const float4*>(src)) : *reinterpret_cast<const float4*>(src);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    const float2 x = kPastL1 ? __ldcg(reinterpret_cast<const float2*>(src)) : *reinterpret_cast<const float2*>(src);
    v[0] = x.x, v[1] = x.y;
  }
}
template <int CPL>
__device__ __forceinline__ void add_split(float (&acc)[CPL], float f, const float (&v)[CPL]) {
#pragma unroll
  for (int i = 0; i < CPL; ++i) acc[i] = fmaf(f, v[i], acc[i]);
}

// The fused merge (Partials::arrivals): the CTA that writes the last partial of (tile, bh) merges
// all of them into out / final_ml, each output as combine_kernel computes it (its max over the
// parts, then per combine warp w the parts w, w + 8, ... accumulated in order by fmaf, the warps'
// sums added in order), so the fused and the launched merge agree to the bit. The partials of the
// other CTAs (of this kernel or of another segment of the call) are read past L1. scratch: shared
// memory of at least kTileRows floats.
template <int D>
__device__ void merge_parts(const QueryArgs& a, int tile, int bh, int rows, const Partials& parts, float* scratch) {
  constexpr int CPL = D / 32;  // channels per item (combine_kernel's lane)
  const long long tiles = a.tiles(), BH = static_cast<long long>(a.B) * a.Hkv;
  const int P = parts.parts;
  const auto slot = [&](int p, int row) {
    return ((static_cast<long long>(p) * tiles + tile) * BH + bh) * kTileRows + row;
  };
  float* row_max = scratch;  // [kTileRows]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int row = warp; row < rows; row += kWarps) {
    float M = -INFINITY;
    for (int p = lane; p < P; p += 32) M = fmaxf(M, __ldcg(parts.ml + slot(p, row) * 2));
    M = max_over(M, 1, 32);
    if (lane == 0) row_max[row] = M;
  }
  __syncthreads();
  const long long b = bh / a.Hkv, h = bh % a.Hkv;
  for (int item = threadIdx.x; item < rows * 32; item += kThreads) {
    const int row = item / 32, c0 = (item % 32) * CPL;
    const float M = row_max[row];
    float A[CPL], L = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) A[i] = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < kCombineWarps; ++w) {
        float acc[CPL], l = 0.f;
#pragma unroll
        for (int i = 0; i < CPL; ++i) acc[i] = 0.f;
#pragma unroll 4
        for (int p = w; p < P; p += kCombineWarps) {
          const float mp = __ldcg(parts.ml + slot(p, row) * 2), lp = __ldcg(parts.ml + slot(p, row) * 2 + 1);
          const float f = mp == -INFINITY ? 0.f : exp2f(mp - M);
          l = fmaf(f, lp, l);
          float v[CPL];
          load_split<CPL, true>(v, parts.acc + slot(p, row) * D + c0);
          add_split<CPL>(acc, f, v);
        }
#pragma unroll
        for (int i = 0; i < CPL; ++i) A[i] += acc[i];
        L += l;
      }
    }
    const long long m = static_cast<long long>(tile) * kTileRows + row;
    const long long s = m / a.G, j = m % a.G;
    float* dst = parts.out + ((b * a.S + s) * a.Hq + h * a.G + j) * D + c0;
#pragma unroll
    for (int i = 0; i < CPL; ++i) dst[i] = L > 0.f ? A[i] / L : 0.f;
    if (c0 == 0 && parts.final_ml != nullptr) {
      parts.final_ml[(bh * a.S * a.G + m) * 2] = M;
      parts.final_ml[(bh * a.S * a.G + m) * 2 + 1] = L;
    }
  }
}

// red = [kWarps][kTileRows][D] unnormalised accumulators, then [kWarps][kTileRows][2] (max, sum),
// filled by the kernel's warps -> one partial (the warps' online-softmax states merged). Only the
// tile's rows that exist (query vectors < S * G) are read and written. With the fused merge
// (parts.arrivals), the CTA then arrives at its (tile, bh) counter, and the last to arrive merges
// every part (merge_parts, red as its scratch).
template <int D>
__device__ void merge_warps(const QueryArgs& a, int tile, int bh, float* red, const Partials& parts, int part) {
  const float* red_acc = red;
  const float* red_ml = red + kWarps * kTileRows * D;
  const long long tiles = a.tiles(), BH = static_cast<long long>(a.B) * a.Hkv;
  const long long base = ((static_cast<long long>(part) * tiles + tile) * BH + bh) * kTileRows;
  const long long left = static_cast<long long>(a.S) * a.G - static_cast<long long>(tile) * kTileRows;
  const int rows = left < kTileRows ? static_cast<int>(left) : kTileRows;
  for (int i = threadIdx.x; i < rows * D; i += kThreads) {
    const int row = i / D, c = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_ml[(w * kTileRows + row) * 2]);
    float A = 0.f, L = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = red_ml[(w * kTileRows + row) * 2];
        const float f = mw == -INFINITY ? 0.f : exp2f(mw - M);
        A += f * red_acc[(w * kTileRows + row) * D + c];
        L += f * red_ml[(w * kTileRows + row) * 2 + 1];
      }
    }
    parts.acc[(base + row) * D + c] = A;
    if (c == 0) {
      parts.ml[(base + row) * 2] = M;
      parts.ml[(base + row) * 2 + 1] = L;
    }
  }
  if (parts.arrivals == nullptr) return;
  // The fused merge: this CTA's partial is visible before it arrives; the last arrival reads them all.
  __threadfence();
  __syncthreads();  // (every thread's stores fenced; red is read no more)
  int* last = reinterpret_cast<int*>(red);
  if (threadIdx.x == 0) {
    unsigned* counter = parts.arrivals + static_cast<long long>(tile) * BH + bh;
    const bool is_last = atomicAdd(counter, 1u) + 1u == static_cast<unsigned>(parts.parts);
    if (is_last) *counter = 0u;  // the next call (a replay) counts from zero
    *last = is_last ? 1 : 0;
  }
  __syncthreads();
  if (*last == 0) return;
  __threadfence();
  __syncthreads();  // (every thread read the flag before merge_parts reuses red)
  merge_parts<D>(a, tile, bh, rows, parts, red);
}

// The int8 tensor cores' products (the int8 codes kernel, attend_codes.cu, and the decode codes
// kernel's keys, attend_codes_half.cu).
// The s32 accumulators start at the bits of 1.5 * 2^23 (as a float): a sum s with |s| < 2^22 leaves
// them holding the float 1.5 * 2^23 + s exactly, so one FADD converts it (sum_of) where I2F, a
// quarter-rate conversion, would (|s| <= 128 * 255 * 128 < 2^22: D = 128 channels of 8-bit codes
// times a digit; values: 32 tokens).
constexpr int kSumBias = 0x4B400000;
__device__ __forceinline__ float sum_of(int biased) { return __int_as_float(biased) - 12582912.f; }

// C (s32) += A (16 x 32 u8) B (32 x 8 s8).
__device__ __forceinline__ void imma16832(int (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                          std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D (s32) = A (16 x 32 u8) B (32 x 8 s8) + cin in every element (one register: no moves to start a sum).
__device__ __forceinline__ void imma16832_from(int (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                               std::uint32_t a3, std::uint32_t b0, std::uint32_t b1, int cin) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(cin));
}

// 2^x by the SFU alone (ex2.approx.ftz: exp2f's own instruction without its denormal handling):
// x <= 0 in the kernels' softmax (<= kLeanSlack = 8 in attend_codes_half.cu's), and results below
// 2^-126 are weights too small to count anyway.
__device__ __forceinline__ float exp2_sfu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// N 32-bit words from shared memory at p (aligned to min(4N, 16) bytes).
template <int N>
__device__ __forceinline__ void load_words(const unsigned char* p, std::uint32_t* w) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const std::uint32_t*>(p);
  }
}

// A lane's share of 4 consecutive token rows of value codes: BPLV bytes of each row (row bytes RB)
// from p, as NWV words per row (BPLV = 2: one 16-bit load).
template <int BPLV, int NWV, int RB>
__device__ __forceinline__ void load_quad_rows(const unsigned char* p, std::uint32_t (&w)[4][NWV]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (BPLV >= 4) {
      load_words<NWV>(p + i * RB, w[i]);
    } else {
      w[i][0] = *reinterpret_cast<const std::uint16_t*>(p + i * RB);
    }
  }
}

// Programmatic dependent launch (sm_90): the attention launches of one call follow each other on
// the stream (codes, then the window's dense rows, then the merge); a kernel that lets its
// dependents launch early hides their launch latency. A dependent that reads the earlier kernels'
// output waits for them (pdl_wait) first; one that does not still waits before it exits, so that
// waiting for it covers everything before it.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

template <typename Kernel>
void set_smem_always(Kernel k, int bytes) {
  KVSLIM_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Raises a kernel's dynamic shared-memory limit once per process and device (the launch path
// stays a launch). `done` is the caller's own flag word: one per kernel instantiation.
template <typename Kernel>
void set_smem(Kernel k, int bytes, std::atomic<unsigned long long>& done) {
  int device = 0;
  KVSLIM_CUDA_CHECK(cudaGetDevice(&device));
  const unsigned long long bit = device < 64 ? 1ull << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return;
  set_smem_always(k, bytes);
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <typename Kernel>
int resident_ctas(Kernel k, int smem) {
  int n = 0;
  KVSLIM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kThreads, smem));
  return n;
}

// Splits so that the grid is one full wave of resident CTAs (`resident` per SM, from the kernel's
// occupancy): fewer leave SMs idle at small batch, more add a partial second wave.
inline int splits_for(const QueryArgs& q, int units, int sm_count, int resident) {
  if (units <= 0) return 0;
  const long long ctas = static_cast<long long>(q.tiles()) * q.B * q.Hkv;
  const long long wave = static_cast<long long>(sm_count) * std::max(resident, 1);
  const long long want = std::max(1LL, wave / ctas);
  const long long most = (units + 2 * kWarps - 1) / (2 * kWarps);  // >= 2 units a warp
  return static_cast<int>(std::max(1LL, std::min(want, most)));
}

}  // namespace kvslim::cuda::attend_detail
