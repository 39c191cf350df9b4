// `kvslim bench attend --device cuda`: decode attention of kvslim's device caches at batch x context
// shapes, each kernel's time, the bytes it reads per second against this GPU's copy bandwidth
// (measured by the same run), and the fused append against a bf16 copy of the same K/V.
// bench/cuda/sdpa_bench.py runs torch SDPA at the same shapes and prints the ratios.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace kvslim::cli {

struct CudaAttendOptions {
  std::vector<std::size_t> batches{1, 8, 32};
  std::vector<std::size_t> contexts{8192, 32768, 131072};
  std::vector<int> head_dims{128, 64};
  int kv_heads = 8, q_heads = 32, repeats = 20, device = 0;
  std::vector<std::string> caches{"full", "kivi4", "kivi2"};
  std::string json;  // write every row here too
  // The eager calls' stream: the legacy default stream (torch's default, the default here) or one
  // the bench creates (cudaStreamNonBlocking, as the graph timing's capture stream).
  bool eager_own_stream = false;
};

// Returns the exit code; throws on CUDA errors.
int run_cuda_attend_bench(const CudaAttendOptions& o);

}  // namespace kvslim::cli
