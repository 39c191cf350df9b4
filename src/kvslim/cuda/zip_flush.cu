// zipcache's block compression kernels (zip_flush.h): norms, the per-head selection of the salient
// rows, then each set's groups quantized into 32-row units.
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/group_quant.cuh"
#include "cuda/kernel_launch.h"
#include "cuda/zip_flush.h"

namespace kvslim::cuda {
namespace {

__device__ __forceinline__ float window_value(const std::uint16_t* w, long long at) {
  const std::uint16_t bits = w[at];
  return __half2float(*reinterpret_cast<const __half*>(&bits));
}

// L2 norm of each key row of the block, accumulated in double (the CPU's row_norms_f16: every square
// of an fp16 value is exact in double, so the sums agree wherever they are exact, whatever the order).
// Grid (ceil(m / 8), BH), 8 warps: a warp a row.
constexpr int kNormThreads = 256;
__global__ void __launch_bounds__(kNormThreads) zip_norms_kernel(ZipFlush f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, bh = blockIdx.y;
  const int row = blockIdx.x * (kNormThreads / 32) + warp;
  if (row >= f.m) return;
  const long long base = (static_cast<long long>(bh) * f.window_capacity + row) * f.D;
  double acc = 0.0;
  for (int c = lane; c < f.D; c += 32) {
    const double x = window_value(f.k, base + c);
    acc += x * x;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) f.norms[static_cast<long long>(bh) * f.m + row] = sqrt(acc);
}

// One CTA per head: the n_hi largest norms under the order (norm, row) -- the tail of a stable
// ascending sort, as the CPU's saliency_mask -- found by a radix select over the norms' bits
// (non-negative doubles order as their bit patterns), then each row's place in its set.
constexpr int kSelectThreads = 1024;
__global__ void __launch_bounds__(kSelectThreads) zip_select_kernel(ZipFlush f) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[256];
  __shared__ unsigned long long prefix_s;
  __shared__ int remaining_s, carry_s;
  const int bh = blockIdx.x, m = f.m, t = threadIdx.x;
  const double* norms = f.norms + static_cast<long long>(bh) * m;
  std::uint8_t* salient = f.salient + static_cast<long long>(bh) * m;
  const auto key_of = [&](int i) { return static_cast<unsigned long long>(__double_as_longlong(norms[i])); };

  // 1. The threshold key T (the n_hi-th largest) and how many rows equal to T are salient.
  if (t == 0) {
    prefix_s = 0;
    remaining_s = f.n_hi;
  }
  __syncthreads();
  unsigned long long mask = 0;
  for (int shift = 56; shift >= 0 && f.n_hi > 0 && f.n_hi < m; shift -= 8) {
    for (int b = t; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    const unsigned long long prefix = prefix_s;
    for (int i = t; i < m; i += kSelectThreads) {
      const unsigned long long key = key_of(i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
    }
    __syncthreads();
    if (t == 0) {
      int want = remaining_s, b = 255;
      for (; b > 0 && hist[b] < want; --b) want -= hist[b];
      remaining_s = want;
      prefix_s = prefix | (static_cast<unsigned long long>(b) << shift);
    }
    mask |= 255ull << shift;
    __syncthreads();
  }
  const unsigned long long T = prefix_s;
  const int take_equal = remaining_s;  // rows == T that are salient: the last ones

  // 2. Salient: above T, or equal to T among the take_equal last such rows (a scan from the end).
  if (t == 0) carry_s = 0;
  __syncthreads();
  for (int chunk_end = m; chunk_end > 0; chunk_end -= kSelectThreads) {
    const int i = chunk_end - 1 - t;  // rows in descending order across the chunk's threads
    const bool in = i >= 0;
    const unsigned long long key = in ? key_of(in ? i : 0) : 0;
    const bool equal = in && f.n_hi > 0 && f.n_hi < m && key == T;
    int before = 0, total = 0;  // equal rows after row i in this chunk, and in the whole chunk
    Scan(scan).ExclusiveSum(equal ? 1 : 0, before, total);
    if (in) {
      bool s;
      if (f.n_hi == 0) s = false;
      else if (f.n_hi >= m) s = true;
      else s = key > T || (equal && carry_s + before < take_equal);
      salient[i] = s ? 1 : 0;
    }
    __syncthreads();
    if (t == 0) carry_s += total;
    __syncthreads();
  }

  // 3. Each row's place in its set (token order): members = hi rows, then lo rows; the mask bits.
  if (t == 0) carry_s = 0;
  __syncthreads();
  int* members = f.members + static_cast<long long>(bh) * m;
  for (int chunk = 0; chunk < m; chunk += kSelectThreads) {
    const int i = chunk + t;
    const bool in = i < m;
    const bool s = in && salient[i] != 0;
    int before = 0, total = 0;
    Scan(scan).ExclusiveSum(s ? 1 : 0, before, total);
    const int hi_index = carry_s + before;
    if (in) members[s ? hi_index : f.n_hi + (i - hi_index)] = i;
    const unsigned bits = __ballot_sync(0xffffffffu, s);
    if (in && t % 32 == 0) f.mask[static_cast<long long>(bh) * f.mask_words + (f.first_token + i) / 32] = bits;
    __syncthreads();
    if (t == 0) carry_s += total;
    __syncthreads();
  }
}

// Grid (groups of the larger set, BH, 4 = set (hi, lo) x (keys, values)), D threads (a channel each):
// the group's rows of its set, min / max per channel, the parameters (written for each of the group's
// units), then each unit's codes through shared memory into the plane layout; the keys' blocks also
// write the units' positions (INT64_MAX in an empty slot), and head 0's which of them begin the group.
__global__ void zip_quantize_kernel(ZipFlush f) {
  extern __shared__ unsigned char codes[];  // [32][D]
  const int gi = blockIdx.x, bh = blockIdx.y, set = blockIdx.z / 2, which = blockIdx.z % 2, c = threadIdx.x, D = f.D;
  const ZipSet& st = set == 0 ? f.hi : f.lo;
  const int n = set == 0 ? f.n_hi : f.m - f.n_hi;  // rows of this set
  const int first = gi * f.group_rows;             // the group's first row of the set
  if (first >= n) return;
  const int rows = min(f.group_rows, n - first);
  const int* members = f.members + static_cast<long long>(bh) * f.m + (set == 0 ? 0 : f.n_hi) + first;
  const std::uint16_t* w = which ? f.v : f.k;
  const long long head = static_cast<long long>(bh) * f.window_capacity;
  const int bits = which ? st.v_bits : st.k_bits, RB = D * bits / 8;
  float mn = INFINITY, mx = -INFINITY;
  for (int r = 0; r < rows; ++r) {
    const float x = window_value(w, (head + members[r]) * D + c);
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  std::uint16_t scale_h, zero_h;
  float scale_f, zero_f;
  make_params(mn, mx, bits, scale_h, zero_h, scale_f, zero_f);
  const int units = (rows + 31) / 32;
  const long long unit0 = st.n_units + first / 32;  // the group's first unit in the set's store
  std::uint16_t* params = (which ? st.v_params : st.k_params) + (static_cast<long long>(bh) * (st.capacity / 32) + unit0) * 2 * D;
  std::uint8_t* out = (which ? st.v_codes : st.k_codes) + (static_cast<long long>(bh) * st.capacity + unit0 * 32) * RB;
  if (bh == 0 && which == 0 && c < units) st.unit_starts[unit0 + c] = c == 0 ? 1 : 0;
  for (int u = 0; u < units; ++u) {
    params[u * 2 * D + c] = scale_h;
    params[u * 2 * D + D + c] = zero_h;
    for (int r = 0; r < 32; ++r) {
      const int row = 32 * u + r;
      codes[r * D + c] = row < rows ? quantize_code(window_value(w, (head + members[row]) * D + c), zero_f, scale_f, bits) : 0;
    }
    __syncthreads();
    pack_unit(codes, D, bits, out + 32LL * u * RB);
    __syncthreads();  // codes is written again
    if (which == 0) {
      for (int r = c; r < 32; r += blockDim.x) {
        const int row = 32 * u + r;
        st.pos[static_cast<long long>(bh) * st.capacity + (unit0 + u) * 32 + r] = row < rows ? f.pos[members[row]] : INT64_MAX;
      }
    }
  }
}

}  // namespace

void launch_zip_flush(const ZipFlush& f, cudaStream_t stream) {
  // Launch sites in every step, switched off without a block to make (a replayed step's graph holds
  // all three: kernel_launch.h).
  const bool on = f.m > 0;
  launch_kernel(on, false, zip_norms_kernel, dim3((f.m + kNormThreads / 32 - 1) / (kNormThreads / 32), f.BH),
                dim3(kNormThreads), 0, stream, f);
  launch_kernel(on, false, zip_select_kernel, dim3(f.BH), dim3(kSelectThreads), 0, stream, f);
  const int larger = f.n_hi > f.m - f.n_hi ? f.n_hi : f.m - f.n_hi;
  const int groups = (larger + f.group_rows - 1) / f.group_rows;
  launch_kernel(on, false, zip_quantize_kernel, dim3(groups, f.BH, 4), dim3(f.D), static_cast<std::size_t>(32 * f.D),
                stream, f);
}

}  // namespace kvslim::cuda
