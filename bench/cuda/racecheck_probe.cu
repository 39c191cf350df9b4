// Does compute-sanitizer's racecheck follow a hand-over between two warps through named barriers
// (bar.arrive by one side, bar.sync by the other), the protocol of the decode codes kernel's pairs of
// warps (docs/benchmarks/cuda/pending_s59)? Four forms of one hand-over, each run alone:
//   arrive:   two buffers; the writer waits "empty" (bar.sync) before it writes a buffer again and
//             signals "full" (bar.arrive); the reader waits "full" (bar.sync) and signals "empty"
//             (bar.arrive) after it has read. Correct by PTX's barrier semantics: accesses before
//             bar.arrive are performed relative to the threads that complete the barrier.
//   racy:     no barrier between the writes and the reads: a real race (the tool's positive control).
//   mbarrier: the `arrive` protocol through mbarriers (arrive .release, try_wait .acquire).
//   sync:     one buffer, both warps bar.sync after the write and after the read (lock step).
// Each prints the sum the readers saw against the expected one. Run on the GPU machine:
//   for m in arrive racy mbarrier sync; do compute-sanitizer --tool racecheck ./racecheck_probe $m; done
// Built here: nvcc -std=c++17 -O3 -arch=sm_90 -o devbin/racecheck_probe bench/cuda/racecheck_probe.cu
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kUnits = 64;  // hand-overs a pair makes
constexpr int kPairs = 2;   // a CTA of 4 warps: 2 pairs, as the kernel

enum Mode { kArrive, kRacy, kMbarrier, kSync };

__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 64;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__global__ void hand_over(int mode, long long* sums) {
  __shared__ int hand[kPairs][2][32];
  __shared__ std::uint64_t full[kPairs][2], empty[kPairs][2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, pair = warp / 2;
  const bool writer = warp % 2 == 0;
  if (mode == kMbarrier && threadIdx.x == 0) {
    for (int p = 0; p < kPairs; ++p) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(&full[p][b], 32);
        mbar_init(&empty[p][b], 32);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int bar_full = 1 + 4 * pair, bar_empty = 3 + 4 * pair;  // + buffer (0 is __syncthreads')
  long long sum = 0;
  for (int i = 0; i < kUnits; ++i) {
    const int buf = mode == kSync ? 0 : i & 1;
    volatile int* slot = &hand[pair][buf][lane];
    if (writer) {
      if (mode == kArrive && i >= 2) bar_sync(bar_empty + buf);
      if (mode == kMbarrier && i >= 2) mbar_wait(&empty[pair][buf], ((i / 2) - 1) & 1);
      *slot = 1000 * i + lane;
      if (mode == kArrive) bar_arrive(bar_full + buf);
      if (mode == kMbarrier) mbar_arrive(&full[pair][buf]);
      if (mode == kSync) {
        bar_sync(bar_full);
        bar_sync(bar_empty);
      }
    } else {
      if (mode == kArrive) bar_sync(bar_full + buf);
      if (mode == kMbarrier) mbar_wait(&full[pair][buf], (i / 2) & 1);
      if (mode == kSync) bar_sync(bar_full);
      sum += *slot;
      if (mode == kArrive) bar_arrive(bar_empty + buf);
      if (mode == kMbarrier) mbar_arrive(&empty[pair][buf]);
      if (mode == kSync) bar_sync(bar_empty);
    }
  }
  // The writer takes the reader's last two "empty" signals, which no later write waited for.
  if (writer && mode == kArrive) {
    for (int i = kUnits - 2; i < kUnits; ++i) bar_sync(bar_empty + (i & 1));
  }
  if (writer && mode == kMbarrier) {
    for (int i = kUnits - 2; i < kUnits; ++i) mbar_wait(&empty[pair][i & 1], (i / 2) & 1);
  }
  if (!writer) sums[pair * 32 + lane] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const char* names[] = {"arrive", "racy", "mbarrier", "sync"};
  int mode = -1;
  for (int m = 0; m < 4; ++m) {
    if (argc == 2 && std::strcmp(argv[1], names[m]) == 0) mode = m;
  }
  if (mode < 0) {
    std::fprintf(stderr, "usage: racecheck_probe arrive|racy|mbarrier|sync\n");
    return 2;
  }
  long long* sums = nullptr;
  if (cudaMalloc(&sums, kPairs * 32 * sizeof(long long)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 1;
  }
  hand_over<<<1, 32 * 2 * kPairs>>>(mode, sums);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", names[mode], cudaGetErrorString(e));
    return 1;
  }
  long long host[kPairs * 32];
  cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int p = 0; p < kPairs; ++p) {
    for (int lane = 0; lane < 32; ++lane) {
      const long long want = 1000LL * kUnits * (kUnits - 1) / 2 + static_cast<long long>(kUnits) * lane;
      wrong += host[p * 32 + lane] != want;
    }
  }
  std::printf("%s: %d of %d readers' sums wrong\n", names[mode], wrong, kPairs * 32);
  return wrong == 0 ? 0 : 3;
}
