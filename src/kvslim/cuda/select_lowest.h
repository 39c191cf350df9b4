// Each head's `drop` lowest rows by (effective score, position) on the device: the eviction core's
// choose_holes (src/kvslim/cache/eviction_core.cc) for the many victims of a prompt's window or of
// squeeze's adopted budget, without reading the rows' metadata back to the host.
//
// A row is a 64-bit key: its score's bits in an order-preserving form above its position's low 32
// bits. Keys order as the core orders candidates (the lower score first, ties to the lower
// position), as long as positions are below 2^32 and distinct within a head (they are token
// positions). kNotCandidate marks a row that may not leave (a sink, a recent row, padding, a masked
// row). One CTA a head runs a radix select, 8 passes of 8 bits, for the head's drop-th smallest key;
// the victims are the keys at or below it: exactly `drop` rows.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvslim::cuda {

constexpr std::uint64_t kNotCandidate = ~0ull;

// The key of a candidate row. Scores are finite (the core rejects non-finite observations); -0.0
// takes +0.0's key, since the core's comparison finds them equal and orders them by position. A
// position outside [0, 2^32) has no key: the caller decides such a head on the host.
__host__ __device__ inline std::uint64_t selection_key(float score, std::int64_t position) {
  if (score == 0.f) score = 0.f;
  std::uint32_t bits;
#ifdef __CUDA_ARCH__
  bits = __float_as_uint(score);
#else
  std::memcpy(&bits, &score, sizeof(bits));
#endif
  // Negative floats: all bits flipped (larger magnitude = smaller); others: the sign bit set.
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<std::uint64_t>(bits) << 32) | static_cast<std::uint32_t>(position);
}

// kth[h] = the drop[h]-th smallest key of keys[h * stride + i], i < n: each head's victims are its
// keys <= kth[h]. drop[h] == 0: kth[h] = 0 (no key is 0: it would be a NaN score's). Fewer than
// drop[h] candidates: kth[h] = kNotCandidate (the caller names the logic error).
void launch_select_lowest(const std::uint64_t* keys, long long n, long long stride, const int* drop, int heads,
                          std::uint64_t* kth, cudaStream_t stream);

// A store's trim: launch_select_lowest with the same `drop` for each of `heads` heads over keys
// [heads, n], then the results read back (waits for the stream). true: every head had `drop`
// candidates and no candidate lacked a key (*unkeyed, device, is 0), so each head's victims are
// its keys <= kth[head] (device [heads]); false: nothing is decided (the host core decides).
bool choose_lowest(const std::uint64_t* keys, long long n, std::size_t heads, std::size_t drop, const int* unkeyed,
                   std::uint64_t* kth, cudaStream_t stream);

}  // namespace kvslim::cuda
