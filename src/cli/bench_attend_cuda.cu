#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cli/bench_attend_cuda.h"
#include "kvslim/cuda.h"
#include "kvslim/factory.h"
#include "kvslim/methods.h"
#include "kvslim/zipcache.h"

namespace kvslim::cli {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(std::size_t bytes) { check(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc"); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Normal-ish values (sum of uniforms) from a counter hash: reproducible, no host traffic.
__global__ void fill_kernel(__nv_bfloat16* bf, float* f32, std::size_t n, unsigned seed, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed * 2246822519u ^ static_cast<unsigned>(i >> 32);
    float s = 0.f;
    for (int k = 0; k < 4; ++k) {
      x ^= x >> 15;
      x *= 2246822519u;
      x ^= x >> 13;
      s += static_cast<float>(x & 0xffffu) / 65535.f;
    }
    const float v = (s - 2.f) * 1.7320508f * scale;
    if (bf) bf[i] = __float2bfloat16_rn(v);
    if (f32) f32[i] = v;
  }
}

void fill(void* bf16, float* f32, std::size_t n, unsigned seed, float scale = 1.f) {
  fill_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(bf16), f32, n, seed, scale);
  check(cudaGetLastError(), "fill_kernel");
}

// A cache by method spec (kvslim/methods.h: a method or one of the registry's eval variants, e.g.
// kivi4, optionally @field=value,...) on `device`. The bench models the bytes of dense and
// quantizer storage; the eviction methods the device takes are measured by kvslim.hf instead.
KVCacheConfig config_of(const std::string& name, int device) {
  KVCacheConfig c = config_from_spec(name);
  c.device = "cuda:" + std::to_string(device);
  c.validate();  // refuses a method the device does not take, naming those it takes
  if (method_info(c.method).kind == MethodKind::eviction) {
    throw std::invalid_argument("--cache " + name + ": bench attend --device cuda measures dense and quantized storage, not " +
                                c.method);
  }
  return c;
}

// Bytes one decode attend reads from the storage (what a perfect kernel must read): fp16 K and V,
// or (a quantizer on the device: kivi's layout) codes (keys and values at their widths) + fp16 scale
// and zero per group and channel
// + the fp16 window not yet compressed; a position per row or group.
double storage_bytes(const KVCacheConfig& c, std::size_t B, std::size_t H, std::size_t N, std::size_t D) {
  if (method_info(c.method).kind == MethodKind::dense) return static_cast<double>(B * H * N * D * 2 * 2 + N * 8);
  if (c.method == "zipcache") {
    // One block of the prompt's complete groups (DeviceZipCache): each set's 32-row units (the last
    // part-filled) of keys at its width and values at value_bits, fp16 scale + zero per group of the
    // set and channel (stored in each unit; decode reads them once a group when a group has two or
    // more units, PackedRows::unit_starts), the newest position of each unit (the codes kernel reads
    // one per unit unless a row may be newer than the query); then the window.
    const std::size_t group = static_cast<std::size_t>(c.zipcache_group_size);
    const std::size_t staged = N >= static_cast<std::size_t>(c.zipcache_staging) ? N % group : N, rows = N - staged;
    const std::size_t n_hi = salient_count(rows, c.zipcache_hi_fraction);
    const std::size_t hi_units = (n_hi + 31) / 32, lo_units = (rows - n_hi + 31) / 32;
    const std::size_t vb = static_cast<std::size_t>(c.zipcache_value_bits == -1 ? c.zipcache_hi_bits : c.zipcache_value_bits);
    const double codes = static_cast<double>(B * H * 32 * D) *
                         static_cast<double>(hi_units * (static_cast<std::size_t>(c.zipcache_hi_bits) + vb) +
                                             lo_units * (static_cast<std::size_t>(c.zipcache_lo_bits) + vb)) / 8.0;
    const std::size_t param_sets =
        group >= 64 ? (n_hi + group - 1) / group + (rows - n_hi + group - 1) / group : hi_units + lo_units;
    const double params = static_cast<double>(B * H * param_sets * 2 * D * 2) * 2;
    const double window = static_cast<double>(B * H * staged * D * 2 * 2);
    return codes + params + window + static_cast<double>(B * H * (hi_units + lo_units) * 8 + staged * 8);
  }
  const std::size_t group = static_cast<std::size_t>(c.kivi_group_size);
  const std::size_t bits = static_cast<std::size_t>(c.kivi_keys_at() + c.kivi_values_at());  // keys' + values'
  const std::size_t staged = N >= static_cast<std::size_t>(c.kivi_staging) ? N % group : N;
  const std::size_t rows = N - staged, groups = rows / group;
  const double codes = static_cast<double>(B * H * rows * D * bits / 8);
  const double params = static_cast<double>(B * H * groups * 2 * D * 2) * 2;
  const double window = static_cast<double>(B * H * staged * D * 2 * 2);
  return codes + params + window + static_cast<double>(groups + staged) * 8;
}

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  return ms;
}

void write_json(const std::string& path, const std::string& rows_so_far) {
  if (path.empty()) return;
  std::ofstream f(path);
  f << rows_so_far << "]}\n";
  if (!f) throw std::runtime_error("--json " + path + ": cannot write");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// GPU ms of one run() on `stream`, between two events.
double timed_ms(const std::function<void()>& run, cudaEvent_t e0, cudaEvent_t e1, cudaStream_t stream) {
  check(cudaEventRecord(e0, stream), "record");
  run();
  check(cudaEventRecord(e1, stream), "record");
  check(cudaEventSynchronize(e1), "sync");
  return elapsed_ms(e0, e1);
}

// Runs `run` until the GPU has spent kWarmUpMs on it (at least 3 times): a GPU left idle by the
// caches' set-up starts below its clocks, and 3 calls of a 1 GB read (~1.2 ms) did not bring it
// back -- kivi4 at 8 x 128k timed 470 us a call over 20 repeats and 401 over 60 (device_s61/r5).
constexpr double kWarmUpMs = 50.0;
void warm_up(const std::function<void()>& run, cudaEvent_t e0, cudaEvent_t e1, cudaStream_t stream) {
  double spent = 0;
  for (int n = 0; n < 3 || spent < kWarmUpMs; ++n) spent += timed_ms(run, e0, e1, stream);
}

// Median us per call of `run` (`calls` calls each time) over `repeats` runs on `stream`, by events.
double median_us(const std::function<void()>& run, int repeats, double calls, cudaEvent_t e0, cudaEvent_t e1,
                 cudaStream_t stream) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) t.push_back(timed_ms(run, e0, e1, stream) * 1e3 / calls);
  return median(t);
}

// The same calls (one attend per layer) captured once as a CUDA graph and replayed: the kernels'
// time without the host's launches, as a replayed decode step runs them (kvslim.hf's graph decoder).
// Median us per call over `repeats` replays; -1 where the capture fails (the error is printed).
// Relaxed capture: attend polls the cache's error flag (cudaEventQuery), which the stricter modes
// refuse while a stream captures.
// `stream` outlives the caches (a device cache keeps the last stream it was called on).
double graph_time_us(const std::vector<std::unique_ptr<KVCache>>& caches, QueryBlock qb,
                     const std::vector<std::int64_t>& qpos, float* out, int repeats, cudaEvent_t e0, cudaEvent_t e1,
                     cudaStream_t stream) {
  qb.stream = stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  double us = -1;
  try {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
    try {
      for (auto& c : caches) c->attend(qb, qpos, out);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      throw;
    }
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    const auto replay = [&] { check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); };
    warm_up(replay, e0, e1, stream);
    us = median_us(replay, repeats, static_cast<double>(caches.size()), e0, e1, stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graph timing: %s\n", e.what());
    cudaGetLastError();  // the capture's error is reported, not left for the next call
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamSynchronize(stream);
  return us;
}

}  // namespace

int run_cuda_attend_bench(const CudaAttendOptions& o) {
  if (cuda::device_count() <= o.device) throw std::runtime_error("--device cuda: no CUDA device " + std::to_string(o.device));
  check(cudaSetDevice(o.device), "cudaSetDevice");
  const std::string desc = cuda::device_description(o.device);
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  cudaStream_t graph_stream = nullptr;  // the graph timing's (graph_time_us)
  check(cudaStreamCreateWithFlags(&graph_stream, cudaStreamNonBlocking), "stream");
  cudaStream_t eager_stream = nullptr;  // the eager calls' (nullptr: the legacy default stream)
  if (o.eager_own_stream) check(cudaStreamCreateWithFlags(&eager_stream, cudaStreamNonBlocking), "stream");

  // Device copy bandwidth: bytes read + written per second, median of 10 copies of 2 GiB.
  double copy_gbs = 0;
  {
    const std::size_t n = 2ull << 30;
    Buffer a(n), b(n);
    std::vector<double> t;
    for (int r = 0; r < 12; ++r) {
      const double ms = timed_ms([&] { check(cudaMemcpyAsync(b.p, a.p, n, cudaMemcpyDeviceToDevice), "copy"); }, e0, e1, nullptr);
      if (r >= 2) t.push_back(ms);
    }
    copy_gbs = 2.0 * n / (median(t) * 1e-3) / 1e9;
  }
  const char* stream_name = o.eager_own_stream ? "own" : "legacy";
  std::printf("# %s\n# device copy (read + write): %.0f GB/s\n# us/call: eager calls on the %s stream\n", desc.c_str(), copy_gbs,
              o.eager_own_stream ? "bench's own (non-blocking)" : "legacy default");
  std::printf("%-4s %5s %7s %-6s %10s %10s %12s %9s %7s %6s\n", "D", "batch", "context", "cache", "us/call", "graph us",
              "MB read", "GB/s", "%copy", "layers");
  std::string json = "{\"device\": \"" + desc + "\", \"copy_gbs\": " + std::to_string(copy_gbs) + ", \"eager_stream\": \"" +
                     stream_name + "\", \"rows\": [";
  bool first_row = true;

  for (int D : o.head_dims) {
    for (std::size_t B : o.batches) {
      for (std::size_t N : o.contexts) {
        const std::size_t H = static_cast<std::size_t>(o.kv_heads), Hq = static_cast<std::size_t>(o.q_heads);
        const std::size_t elems = B * H * N * static_cast<std::size_t>(D);
        for (const std::string& name : o.caches) {
          const KVCacheConfig config = config_of(name, o.device);
          const double bytes = storage_bytes(config, B, H, N, static_cast<std::size_t>(D));
          // Enough layers that their storage is several times the L2: the next call never hits it.
          const int layers = static_cast<int>(std::clamp(std::ceil(512e6 / bytes), 1.0, 16.0));
          std::vector<std::unique_ptr<KVCache>> caches;
          {
            Buffer k(elems * 2), v(elems * 2);
            fill(k.p, nullptr, elems, 1);
            fill(v.p, nullptr, elems, 2);
            for (int l = 0; l < layers; ++l) {
              caches.push_back(KVCacheFactory::create(config));
              caches.back()->append(KVBlock{k.p, DType::bf16, B, H, N, static_cast<std::size_t>(D), MemorySpace::cuda, nullptr},
                                    KVBlock{v.p, DType::bf16, B, H, N, static_cast<std::size_t>(D), MemorySpace::cuda, nullptr});
            }
            check(cudaDeviceSynchronize(), "append");
          }
          Buffer q(B * Hq * D * 4), out(B * Hq * D * 4);
          fill(nullptr, static_cast<float*>(q.p), B * Hq * D, 3, 0.5f);
          const QueryBlock qb{static_cast<float*>(q.p), B, 1, Hq, static_cast<std::size_t>(D), 0.f, MemorySpace::cuda, eager_stream};
          const std::vector<std::int64_t> qpos{static_cast<std::int64_t>(N)};
          const auto layers_once = [&] { for (auto& c : caches) c->attend(qb, qpos, static_cast<float*>(out.p)); };
          warm_up(layers_once, e0, e1, eager_stream);
          const double us = median_us(layers_once, o.repeats, layers, e0, e1, eager_stream);
          const double gbs = bytes / (us * 1e-6) / 1e9;
          const double graph_us = graph_time_us(caches, qb, qpos, static_cast<float*>(out.p), o.repeats, e0, e1, graph_stream);
          char graph_col[32] = "n/a";
          if (graph_us > 0) std::snprintf(graph_col, sizeof graph_col, "%.1f", graph_us);
          std::printf("%-4d %5zu %7zu %-6s %10.1f %10s %12.1f %9.0f %6.0f%% %6d\n", D, B, N, name.c_str(), us, graph_col,
                      bytes / 1e6, gbs, 100.0 * gbs / copy_gbs, layers);
          std::fflush(stdout);
          char row[512];
          std::snprintf(row, sizeof row,
                        "%s{\"kind\": \"attend\", \"head_dim\": %d, \"batch\": %zu, \"context\": %zu, \"q_heads\": %zu, "
                        "\"kv_heads\": %zu, \"cache\": \"%s\", \"us\": %.3f, \"graph_us\": %.3f, \"bytes\": %.0f, "
                        "\"gbs\": %.1f, \"layers\": %d}",
                        first_row ? "" : ", ", D, B, N, Hq, H, name.c_str(), us, graph_us, bytes, gbs, layers);
          json += row;
          first_row = false;
          write_json(o.json, json);  // after every row: a run cut short keeps what it measured
        }
      }
    }
  }

  // Fused append of one decode token per sequence (kivi2, B = 8, 32k tokens, D = 128) over 256 steps
  // (two window compressions), against cudaMemcpyAsync of the same bf16 K and V.
  std::printf("\n%-8s %5s %-6s %12s %12s %8s\n", "append", "batch", "cache", "us/step", "bf16 copy", "ratio");
  for (const std::string& name : {std::string("full"), std::string("kivi2"), std::string("kivi4")}) {
    for (std::size_t B : {std::size_t{1}, std::size_t{8}}) {
      const std::size_t H = static_cast<std::size_t>(o.kv_heads), D = 128, N = 32768, steps = 256;
      auto cache = KVCacheFactory::create(config_of(name, o.device));
      cache->reserve(N + steps + 64);
      {
        Buffer k(B * H * N * D * 2);
        fill(k.p, nullptr, B * H * N * D, 4);
        cache->append(KVBlock{k.p, DType::bf16, B, H, N, D, MemorySpace::cuda, nullptr},
                      KVBlock{k.p, DType::bf16, B, H, N, D, MemorySpace::cuda, nullptr});
        check(cudaDeviceSynchronize(), "prefill");
      }
      Buffer step_k(steps * B * H * D * 2), step_v(steps * B * H * D * 2), dst_k(B * H * D * 2), dst_v(B * H * D * 2);
      fill(step_k.p, nullptr, steps * B * H * D, 5);
      fill(step_v.p, nullptr, steps * B * H * D, 6);
      check(cudaDeviceSynchronize(), "fill");
      const std::size_t step_bytes = B * H * D * 2;
      const double append_us = timed_ms([&] {
        for (std::size_t s = 0; s < steps; ++s) {
          const char* kp = static_cast<const char*>(step_k.p) + s * step_bytes;
          const char* vp = static_cast<const char*>(step_v.p) + s * step_bytes;
          cache->append(KVBlock{kp, DType::bf16, B, H, 1, D, MemorySpace::cuda, nullptr},
                        KVBlock{vp, DType::bf16, B, H, 1, D, MemorySpace::cuda, nullptr});
        }
      }, e0, e1, nullptr) * 1e3 / steps;
      const double copy_us = timed_ms([&] {
        for (std::size_t s = 0; s < steps; ++s) {
          check(cudaMemcpyAsync(dst_k.p, static_cast<const char*>(step_k.p) + s * step_bytes, step_bytes,
                                cudaMemcpyDeviceToDevice), "copy");
          check(cudaMemcpyAsync(dst_v.p, static_cast<const char*>(step_v.p) + s * step_bytes, step_bytes,
                                cudaMemcpyDeviceToDevice), "copy");
        }
      }, e0, e1, nullptr) * 1e3 / steps;
      std::printf("%-8s %5zu %-6s %12.2f %12.2f %7.2fx\n", "1 token", B, name.c_str(), append_us, copy_us,
                  append_us / copy_us);
      char row[256];
      std::snprintf(row, sizeof row,
                    ", {\"kind\": \"append\", \"batch\": %zu, \"cache\": \"%s\", \"us\": %.3f, \"copy_us\": %.3f}", B,
                    name.c_str(), append_us, copy_us);
      json += row;
      write_json(o.json, json);
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(graph_stream);
  if (eager_stream) cudaStreamDestroy(eager_stream);
  return 0;
}

}  // namespace kvslim::cli
