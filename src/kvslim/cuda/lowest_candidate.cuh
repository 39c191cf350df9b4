// A decode step's victim on the device, shared by the eviction kernels over fp16 slots
// (device_eviction_cache.cu) and over kivi codes (device_packed_rows.cu): each CTA of a head's
// parts finds its lowest candidate, the last part to finish takes the lowest of the parts'. The
// order is the eviction core's pick_victim: the lowest effective score, ties to the lower position.
// Also the CTA prefix sum those kernels and the device trims (select_lowest.h) count rows with.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/cuda_common.cuh"

namespace kvslim::cuda {

struct Candidate {
  float score;
  std::int64_t pos;
  int slot;  // the row's index in the kernel's row space; -1: none
};

__device__ inline bool lower(const Candidate& a, const Candidate& b) {
  if (a.slot < 0) return false;
  if (b.slot < 0) return true;
  return a.score < b.score || (a.score == b.score && a.pos < b.pos);
}

constexpr int kObserveThreads = 256;
constexpr std::size_t kMaxObserveParts = 16;

// The warp's lowest candidate, in lane 0 (a shuffle tree; a head's rows hold distinct positions,
// so (score, position) orders its candidates strictly and any order of comparisons picks the same).
__device__ inline Candidate warp_lowest(Candidate best) {
  for (int off = 16; off > 0; off /= 2) {
    Candidate other;
    other.score = __shfl_down_sync(0xffffffffu, best.score, off);
    other.pos = __shfl_down_sync(0xffffffffu, best.pos, off);
    other.slot = __shfl_down_sync(0xffffffffu, best.slot, off);
    if (lower(other, best)) best = other;
  }
  return best;
}

// The block's lowest candidate (every thread gets it). Blocks of kObserveThreads threads: the warps'
// lowest, then the lowest of those by warp 0's shuffles (not one thread's loop over shared memory).
__device__ inline Candidate block_lowest(Candidate best) {
  static_assert(kObserveThreads / 32 <= 32, "one warp takes the warps' candidates");
  best = warp_lowest(best);
  __shared__ Candidate warps[kObserveThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = best;
  __syncthreads();
  if (warp == 0) {
    const Candidate lowest = warp_lowest(lane < kObserveThreads / 32 ? warps[lane] : Candidate{0.f, 0, -1});
    __syncwarp();  // every lane has read warps[] before lane 0 writes it
    if (lane == 0) warps[0] = lowest;
  }
  __syncthreads();
  return warps[0];
}

// With several parts per head (grid (heads, parts)): every CTA posts its candidate; the last CTA of
// `head` to arrive (a counter per head, which it resets for the next step or replay) gets the lowest
// of the parts' in `best` and true; the others get false and return. One part: true at once.
__device__ inline bool head_lowest(Candidate& best, Candidate* part_best, unsigned* arrivals, int head, int part,
                                   int parts) {
  best = block_lowest(best);
  if (parts == 1) return true;
  __shared__ bool last_part;
  if (threadIdx.x == 0) {
    part_best[head * parts + part] = best;
    // (block_lowest's barrier put the CTA's writes before this thread's release)
    last_part = arrive_acq_rel(&arrivals[head]) == static_cast<unsigned>(parts - 1);
  }
  __syncthreads();
  if (!last_part) return false;
  // The parts' candidates, one a lane (loads past L1), taken by warp 0's shuffles.
  static_assert(kMaxObserveParts <= 32, "one warp takes the parts' candidates");
  __shared__ Candidate lowest;
  if (threadIdx.x < 32) {
    Candidate c{0.f, 0, -1};
    if (threadIdx.x < parts) {
      const Candidate* p = part_best + head * parts + threadIdx.x;
      c = Candidate{__ldcg(&p->score), __ldcg(&p->pos), __ldcg(&p->slot)};
    }
    c = warp_lowest(c);
    if (threadIdx.x == 0) {
      lowest = c;
      arrivals[head] = 0;  // the next step's count (a replayed graph runs the kernel again)
    }
  }
  __syncthreads();
  best = lowest;
  return true;
}

// Exclusive prefix sum of `value` over the CTA's kObserveThreads threads; *total: their sum.
// T: int, or long long for two counts summed at once (observe_packed_kernel's slot base and rows).
template <typename T>
__device__ inline T cta_exclusive_sum(T value, T* total) {
  __shared__ T warp_sum[kObserveThreads / 32 + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int d = 1; d < 32; d *= 2) {
    const T n = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += n;
  }
  if (lane == 31) warp_sum[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    T run = 0;
    for (int w = 0; w < kObserveThreads / 32; ++w) {
      const T sum = warp_sum[w];
      warp_sum[w] = run;
      run += sum;
    }
    warp_sum[kObserveThreads / 32] = run;
  }
  __syncthreads();
  const T exclusive = warp_sum[warp] + inclusive - value;
  *total = warp_sum[kObserveThreads / 32];
  __syncthreads();  // warp_sum is written again by the next call
  return exclusive;
}

// Parts per head for a step over n rows: about two CTAs per SM over the batch's heads, at least 512
// rows (2 a thread) a part: the step's latency is the rows each thread loads one after the other.
inline std::size_t observe_parts(std::size_t heads, std::size_t n, int sm_count) {
  std::size_t p = std::min<std::size_t>((2 * static_cast<std::size_t>(sm_count) + heads - 1) / heads, (n + 511) / 512);
  return p < 1 ? 1 : (p > kMaxObserveParts ? kMaxObserveParts : p);
}

}  // namespace kvslim::cuda
