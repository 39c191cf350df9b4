// Input blocks handed to a cache: contiguous [B, H_kv, S, D] tensors of fp16, bf16 or fp32, in host
// memory (CPU caches) or in a GPU's memory (caches built with KVCacheConfig.device = "cuda").
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvslim/dtype.h"

namespace kvslim {

// Where a block's data lives. A cache takes blocks of its own space only (InputError otherwise):
// a CUDA cache never copies through the host, a CPU cache never reads device memory.
enum class MemorySpace : std::uint8_t { host, cuda };
std::string_view memory_space_name(MemorySpace space);

struct KVBlock {
  const void* data = nullptr;  // [batch, heads, tokens, head_dim], row-major, contiguous
  DType dtype = DType::f32;
  std::size_t batch = 0, heads = 0, tokens = 0, head_dim = 0;
  MemorySpace space = MemorySpace::host;
  // cuda: the cudaStream_t the caller's work on `data` is ordered on (null = the legacy default
  // stream). The cache enqueues its work on it and returns without waiting.
  void* stream = nullptr;

  std::size_t elements() const { return batch * heads * tokens * head_dim; }
  // Row (b, h, s) as a pointer to head_dim elements of `dtype`.
  const void* row(std::size_t b, std::size_t h, std::size_t s) const {
    const std::size_t idx = ((b * heads + h) * tokens + s) * head_dim;
    return static_cast<const std::uint8_t*>(data) + idx * dtype_size(dtype);
  }
  std::string shape_string() const;
};

inline KVBlock make_block(const float* data, std::size_t b, std::size_t h, std::size_t s, std::size_t d) {
  return KVBlock{data, DType::f32, b, h, s, d};
}
inline KVBlock make_block_fp16(const std::uint16_t* data, std::size_t b, std::size_t h, std::size_t s,
                               std::size_t d) {
  return KVBlock{data, DType::f16, b, h, s, d};
}

}  // namespace kvslim
