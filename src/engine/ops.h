// Numeric kernels of the forward pass: RMSNorm, RoPE (HF rotate_half layout, llama3 scaling),
// softmax, SwiGLU, the decode matrix-vector product (SIMD chosen at run time, bf16/f16/f32 weights
// read directly) and the prefill matrix product (OpenBLAS sgemm over fp32 weight tiles).
// All compute is fp32. Nothing here allocates except the constructors of ThreadPool and RopeTable.
#pragma once
#include <atomic>
#include <exception>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {

// A weight matrix as stored in the model file: [rows = out_features, cols = in_features],
// row-major, element type `type` (for a block type each row is cols / block_elements blocks), or
// an interleaved type (Q4_0x16: 16 rows side by side, repacked at load) whose rows are not
// contiguous: row() is for the others; convert_rows decodes any. Not owned (points into the
// mmap'ed file or the loader's repacked copy).
struct Matrix {
  WeightType type = WeightType::f32;
  const void* data = nullptr;
  std::size_t rows = 0, cols = 0;

  std::size_t row_bytes() const { return weight_bytes(type, cols); }
  std::size_t nbytes() const { return rows * row_bytes(); }
  const void* row(std::size_t r) const { return static_cast<const std::uint8_t*>(data) + r * row_bytes(); }
};

// The library's DType of a plain float weight type (f32/f16/bf16; throws for a block type).
DType to_dtype(WeightType type);
// dst[i] = float(src[i]) for n elements of `type` (exact: bf16/f16 embed into f32; block types:
// the format's own decoding, n a multiple of the block size, src at a block boundary).
void convert_weights(const void* src, WeightType type, float* dst, std::size_t n);
// Rows [r0, r0 + nr) of w as fp32, row-major (every type, interleaved ones included).
void convert_rows(const Matrix& w, std::size_t r0, std::size_t nr, float* dst);
// A whole tensor as fp32 in its logical (row-major) order, every type: a 2-D tensor of an
// interleaved type by its shape, the others as convert_weights.
void convert_tensor(const TensorInfo& t, float* dst);

// A tiny persistent pool: `run(n, fn)` calls fn(i) for i in [0, n) spread over the threads, the
// caller taking part. No allocation per call; workers sleep on an atomic between calls.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // threads >= 1 (1: everything runs on the caller)
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls task(context, i) once for each i < n_tasks; returns when all are done. An exception
  // thrown by a task, on any thread, is rethrown here once every task has finished (the first one
  // thrown; issue 26: one escaping a worker thread aborted the process).
  void run(int n_tasks, void (*task)(void* context, int index), void* context);
  template <class F>
  void for_each(int n_tasks, F& f) {
    run(n_tasks, [](void* c, int i) { (*static_cast<F*>(c))(i); }, &f);
  }

 private:
  void worker_loop();
  void work(std::uint64_t generation);
  std::vector<std::thread> workers_;
  // Tasks are claimed through `ticket_` = [generation:32 | next index:32], so a worker that wakes
  // late can never run a task of a call that is over, and the caller never waits for a sleeping
  // worker: it runs whatever is unclaimed itself and waits only for claimed tasks to finish.
  std::atomic<std::uint64_t> ticket_{0};
  std::atomic<std::uint64_t> wake_{0};  // bumped per call; workers sleep on it
  std::atomic<int> completed_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> n_tasks_{0};
  std::atomic<void (*)(void*, int)> task_{nullptr};
  std::atomic<void*> context_{nullptr};
  std::uint64_t generation_ = 0;  // caller side only
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the first exception of the current call
};

// y[r] = sum_c w[r, c] * x[c]  (x: [cols], y: [rows]). Reads the weights in their stored type with
// the widest SIMD this CPU has; splits the rows over `pool` when the matrix is large enough.
// Block types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) go through engine/quant_gemv.h: x is quantized to
// int8 blocks of 32 once per call and every row is an integer dot product over its stored blocks.
void gemv(const Matrix& w, const float* x, float* y, ThreadPool* pool = nullptr);
// ys[k] = ws[k] x for k < count: several products of one input (decode's q/k/v and gate/up
// projections). With block weights of one activation format, x is quantized once and the pool
// is handed the work once (each thread takes its share of every matrix's rows); otherwise one
// gemv per matrix. Each row's value is gemv's.
void gemv_multi(const Matrix* const* ws, float* const* ys, std::size_t count, const float* x, ThreadPool* pool = nullptr);
// The instruction set gemv uses on this machine ("avx512", "avx2", "scalar").
const char* gemv_target_name();
// Forces the scalar (or a narrower) gemv kernel; for tests and benchmarks. "" restores the best.
void gemv_force_target(const std::string& name);

// Y[s, r] = sum_c X[s, c] * W[r, c]  (X: [n, cols] row stride cols, Y: [n, rows]). f32 weights go
// straight to sgemm; bf16/f16 and block-quantized weights are converted `tile_rows` rows at a time into `tile`
// ([tile_rows, cols] floats, caller-owned), so peak memory stays one tile. With a pool of T
// threads the weight rows are split T ways, each part converting into its own 1/T of the tile
// and calling sgemm itself: BLAS is expected to run single-threaded (the Transformer sets it).
void matmul(const Matrix& w, const float* x, std::size_t n, float* y, float* tile,
            std::size_t tile_rows, ThreadPool* pool = nullptr);

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i] for n elements (out may alias x).
void rmsnorm(float* out, const float* x, const float* weight, std::size_t n, float eps);

// In-place softmax over n values; -inf entries get probability 0. At least one must be finite.
void softmax(float* x, std::size_t n);

// gate[i] = silu(gate[i]) * up[i]  (SwiGLU's elementwise part), n elements.
void swiglu(float* gate, const float* up, std::size_t n);

// RoPE frequencies for one head_dim, with HF's rope_scaling ("default"/"none", "linear", "llama3").
// Throws ModelFileError naming rope_scaling.rope_type for an unsupported scaling.
class RopeTable {
 public:
  RopeTable(const ModelConfig& config);
  RopeTable(int head_dim, double theta, const RopeScaling& scaling);
  int head_dim() const { return head_dim_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }  // [head_dim / 2]
  // cos/sin of position * inv_freq, computed as HF does (fp32 product, fp32 cos/sin).
  void angles(std::int64_t position, float* cos_out, float* sin_out) const;  // [head_dim / 2] each

 private:
  int head_dim_;
  std::vector<float> inv_freq_;
};

// Rotates one head vector x[head_dim] in place, HF rotate_half layout:
// x'[i] = x[i]*c[i] - x[i+h]*s[i], x'[i+h] = x[i+h]*c[i] + x[i]*s[i], h = head_dim/2.
void rope_rotate(float* x, const float* cos, const float* sin, std::size_t head_dim);

}  // namespace kvslim::engine
