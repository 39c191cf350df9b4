#include "cuda/select_lowest.h"

#include <algorithm>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/device_buffer.h"
#include "cuda/kernel_launch.h"

namespace kvslim::cuda {
namespace {

constexpr int kSelectThreads = 256;  // one histogram bin a thread
constexpr int kBinsPerLane = 256 / 32;

// One CTA a head. Pass p counts, among the keys whose bits above the current byte equal the
// prefix chosen so far, how many fall in each value of that byte; the wanted rank's byte is the
// first whose running count reaches it (one warp: each lane sums 8 bins, a warp scan, then the
// lane that crosses the rank walks its 8).
__global__ void __launch_bounds__(kSelectThreads)
    select_lowest_kernel(const std::uint64_t* keys, long long n, long long stride, const int* drop, std::uint64_t* kth) {
  const int head = blockIdx.x, tid = threadIdx.x;
  const std::uint64_t* k = keys + static_cast<long long>(head) * stride;
  __shared__ unsigned hist[256];
  __shared__ std::uint64_t chosen_prefix;
  __shared__ long long chosen_rank;
  const long long want = drop[head];
  if (want <= 0) {
    if (tid == 0) kth[head] = 0;
    return;
  }
  std::uint64_t prefix = 0, mask = 0;
  long long rank = want;  // the wanted key's rank (from 1) among the keys matching prefix under mask
  for (int shift = 56; shift >= 0; shift -= 8) {
    hist[tid] = 0;
    __syncthreads();
    for (long long i = tid; i < n; i += kSelectThreads) {
      const std::uint64_t x = k[i];
      if ((x & mask) == prefix) atomicAdd(&hist[(x >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (tid < 32) {
      long long sum = 0;
      for (int j = 0; j < kBinsPerLane; ++j) sum += hist[tid * kBinsPerLane + j];
      long long inclusive = sum;
      for (int d = 1; d < 32; d *= 2) {
        const long long up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (tid >= d) inclusive += up;
      }
      const unsigned reached = __ballot_sync(0xffffffffu, inclusive >= rank);
      if (reached == 0) {
        if (tid == 0) chosen_rank = -1;  // fewer than `want` keys in all
      } else if (tid == __ffs(reached) - 1) {
        long long before = inclusive - sum;
        int b = tid * kBinsPerLane;
        for (; b < tid * kBinsPerLane + kBinsPerLane - 1; ++b) {
          if (before + hist[b] >= rank) break;
          before += hist[b];
        }
        chosen_prefix = prefix | (static_cast<std::uint64_t>(b) << shift);
        chosen_rank = rank - before;
      }
    }
    __syncthreads();
    if (chosen_rank < 0) {
      if (tid == 0) kth[head] = kNotCandidate;
      return;
    }
    prefix = chosen_prefix;
    rank = chosen_rank;
    mask |= 0xFFull << shift;
    __syncthreads();  // hist and the chosen byte are written again by the next pass
  }
  // Fewer candidates than `want`: the wanted key is a non-candidate's (all ones).
  if (tid == 0) kth[head] = prefix;
}

}  // namespace

void launch_select_lowest(const std::uint64_t* keys, long long n, long long stride, const int* drop, int heads,
                          std::uint64_t* kth, cudaStream_t stream) {
  launch_kernel(heads > 0, false, select_lowest_kernel, dim3(static_cast<unsigned>(heads > 0 ? heads : 1)),
                dim3(kSelectThreads), 0, stream, keys, n, stride, drop, kth);
}

bool choose_lowest(const std::uint64_t* keys, long long n, std::size_t heads, std::size_t drop, const int* unkeyed,
                   std::uint64_t* kth, cudaStream_t stream) {
  DeviceBuffer drops;
  const std::vector<int> drop_per_head(heads, static_cast<int>(drop));
  drops.upload(drop_per_head.data(), heads * sizeof(int), stream);
  launch_select_lowest(keys, n, n, drops.as<int>(), static_cast<int>(heads), kth, stream);
  std::vector<std::uint64_t> kth_host(heads);
  int unkeyed_host = 0;
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(kth_host.data(), kth, heads * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, stream));
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(&unkeyed_host, unkeyed, sizeof(int), cudaMemcpyDeviceToHost, stream));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  // A kth of 0 is no finite score's key (it is a NaN's): with drop > 0 it can only mean the select
  // never ran over these counts, so the host decides rather than trusting it.
  return unkeyed_host == 0 && std::find(kth_host.begin(), kth_host.end(), kNotCandidate) == kth_host.end() &&
         (drop == 0 || std::find(kth_host.begin(), kth_host.end(), std::uint64_t{0}) == kth_host.end());
}

}  // namespace kvslim::cuda
