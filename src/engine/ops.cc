#include "engine/ops.h"

// GCC 12 reports a false -Wmaybe-uninitialized inside its own AVX-512 intrinsic headers
// (the _mm512_undefined_* idiom); nothing in this file reads uninitialised data.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <cblas.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <utility>
#include <cmath>
#include <numbers>

#include "kvslim/convert.h"
#include "kvslim/dtype.h"
#include "kvslim/activations.h"  // the library's dispatched softmax and SwiGLU
#include "engine/quant_gemv.h"

namespace kvslim::engine {

DType to_dtype(WeightType t) {
  switch (t) {
    case WeightType::f32: return DType::f32;
    case WeightType::f16: return DType::f16;
    case WeightType::bf16: return DType::bf16;
    default: break;
  }
  throw std::invalid_argument(std::string("weight type ") + weight_type_name(t) + " is a block format, not a DType");
}

void convert_weights(const void* src, WeightType type, float* dst, std::size_t n) {
  if (is_block_type(type)) {
    qgemv::dequantize(type, src, dst, n);
    return;
  }
  convert_to_f32(src, to_dtype(type), dst, n);
}

void convert_rows(const Matrix& w, std::size_t r0, std::size_t nr, float* dst) {
  if (weight_interleave_rows(w.type) > 1) {
    qgemv::dequantize_rows(w.type, w.data, w.cols, r0, nr, dst);
    return;
  }
  convert_weights(w.row(r0), w.type, dst, nr * w.cols);
}

void convert_tensor(const TensorInfo& t, float* dst) {
  const std::size_t n = weight_elements(t.type, t.nbytes);
  if (weight_interleave_rows(t.type) > 1) {
    const auto cols = static_cast<std::size_t>(t.shape.at(1));
    convert_rows(Matrix{t.type, t.data, n / cols, cols}, 0, n / cols, dst);
    return;
  }
  convert_weights(t.data, t.type, dst, n);
}

// ------------------------------------------------------------------------------------------------
// ThreadPool

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  wake_.fetch_add(1, std::memory_order_acq_rel);
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work(std::uint64_t generation) {
  for (;;) {
    std::uint64_t t = ticket_.load(std::memory_order_acquire);
    if ((t >> 32) != generation) return;
    const int index = static_cast<int>(t & 0xffffffffu);
    if (index >= n_tasks_.load(std::memory_order_relaxed)) return;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
    // Claimed: the caller cannot start another call before this task completes, so task_ and
    // context_ are this generation's.
    try {
      task_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), index);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    completed_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;
  for (;;) {
    // Spin briefly (decode calls come every few microseconds), then sleep on the futex.
    for (int spin = 0; spin < 4000 && wake_.load(std::memory_order_acquire) == seen; ++spin) _mm_pause();
    wake_.wait(seen, std::memory_order_acquire);
    seen = wake_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    work(ticket_.load(std::memory_order_acquire) >> 32);
  }
}

void ThreadPool::run(int n_tasks, void (*task)(void*, int), void* context) {
  if (workers_.empty() || n_tasks <= 1) {
    for (int i = 0; i < n_tasks; ++i) task(context, i);
    return;
  }
  task_.store(task, std::memory_order_relaxed);
  context_.store(context, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_relaxed);
  completed_.store(0, std::memory_order_relaxed);
  generation_ = (generation_ + 1) & 0xffffffffu;
  ticket_.store(generation_ << 32, std::memory_order_release);  // publishes the stores above
  wake_.fetch_add(1, std::memory_order_acq_rel);
  wake_.notify_all();
  work(generation_);
  // A claimed task is running on a worker: spin briefly, then yield (on an oversubscribed
  // machine that worker may need this core).
  for (int spin = 0; completed_.load(std::memory_order_acquire) < n_tasks; ++spin) {
    if (spin < 2000) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  std::exception_ptr error;
  {
    const std::lock_guard<std::mutex> lock(error_mutex_);
    error = std::exchange(error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

// ------------------------------------------------------------------------------------------------
// gemv kernels: one dot product per weight row, weights loaded in their stored type.

namespace {

float dot_scalar(const void* row, WeightType type, const float* x, std::size_t n) {
  float acc = 0;
  switch (type) {
    case WeightType::f32: {
      const float* w = static_cast<const float*>(row);
      for (std::size_t i = 0; i < n; ++i) acc += w[i] * x[i];
      break;
    }
    case WeightType::f16: {
      const auto* w = static_cast<const std::uint16_t*>(row);
      for (std::size_t i = 0; i < n; ++i) acc += fp16_to_f32(w[i]) * x[i];
      break;
    }
    case WeightType::bf16: {
      const auto* w = static_cast<const std::uint16_t*>(row);
      for (std::size_t i = 0; i < n; ++i) acc += bf16_to_f32(w[i]) * x[i];
      break;
    }
    default: break;  // block types never come here (gemv sends them to qgemv)
  }
  return acc;
}

#define KVSLIM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVSLIM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

KVSLIM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVSLIM_AVX2 inline __m256 load8_f16(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KVSLIM_AVX2 inline __m256 load8_bf16(const std::uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
KVSLIM_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r1) of w times x, AVX2: two independent accumulators per row hide FMA latency.
template <WeightType T>
KVSLIM_AVX2 void gemv_rows_avx2(const Matrix& w, const float* x, float* y, std::size_t r0, std::size_t r1) {
  const std::size_t n = w.cols, n16 = n / 16 * 16;
  for (std::size_t r = r0; r < r1; ++r) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    std::size_t i = 0;
    if constexpr (T == WeightType::f32) {
      const float* row = static_cast<const float*>(w.row(r));
      for (; i < n16; i += 16) {
        a0 = _mm256_fmadd_ps(load8(row + i), load8(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(row + i + 8), load8(x + i + 8), a1);
      }
    } else {
      const auto* row = static_cast<const std::uint16_t*>(w.row(r));
      for (; i < n16; i += 16) {
        const __m256 w0 = T == WeightType::f16 ? load8_f16(row + i) : load8_bf16(row + i);
        const __m256 w1 = T == WeightType::f16 ? load8_f16(row + i + 8) : load8_bf16(row + i + 8);
        a0 = _mm256_fmadd_ps(w0, load8(x + i), a0);
        a1 = _mm256_fmadd_ps(w1, load8(x + i + 8), a1);
      }
    }
    float acc = hsum8(_mm256_add_ps(a0, a1));
    if (i < n) {
      const std::size_t off = i * weight_type_size(T);
      acc += dot_scalar(static_cast<const std::uint8_t*>(w.row(r)) + off, T, x + i, n - i);
    }
    y[r] = acc;
  }
}

KVSLIM_AVX512 inline __m512 load16_f16(const std::uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
KVSLIM_AVX512 inline __m512 load16_bf16(const std::uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <WeightType T>
KVSLIM_AVX512 void gemv_rows_avx512(const Matrix& w, const float* x, float* y, std::size_t r0,
                                    std::size_t r1) {
  const std::size_t n = w.cols, n32 = n / 32 * 32;
  for (std::size_t r = r0; r < r1; ++r) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    std::size_t i = 0;
    if constexpr (T == WeightType::f32) {
      const float* row = static_cast<const float*>(w.row(r));
      for (; i < n32; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      }
    } else {
      const auto* row = static_cast<const std::uint16_t*>(w.row(r));
      for (; i < n32; i += 32) {
        const __m512 w0 = T == WeightType::f16 ? load16_f16(row + i) : load16_bf16(row + i);
        const __m512 w1 = T == WeightType::f16 ? load16_f16(row + i + 16) : load16_bf16(row + i + 16);
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i + 16), a1);
      }
    }
    float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    if (i < n) {
      const std::size_t off = i * weight_type_size(T);
      acc += dot_scalar(static_cast<const std::uint8_t*>(w.row(r)) + off, T, x + i, n - i);
    }
    y[r] = acc;
  }
}

void gemv_rows_scalar(const Matrix& w, const float* x, float* y, std::size_t r0, std::size_t r1) {
  for (std::size_t r = r0; r < r1; ++r) y[r] = dot_scalar(w.row(r), w.type, x, w.cols);
}

enum class Target { scalar, avx2, avx512 };

// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c".
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & (1u << 29)) != 0;
}

Target best_target() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return Target::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c()) {
    return Target::avx2;
  }
  return Target::scalar;
}

Target& active_target() {
  static Target target = best_target();
  return target;
}

void gemv_rows(const Matrix& w, const float* x, float* y, std::size_t r0, std::size_t r1) {
  switch (active_target()) {
    case Target::avx512:
      switch (w.type) {
        case WeightType::f32: return gemv_rows_avx512<WeightType::f32>(w, x, y, r0, r1);
        case WeightType::f16: return gemv_rows_avx512<WeightType::f16>(w, x, y, r0, r1);
        case WeightType::bf16: return gemv_rows_avx512<WeightType::bf16>(w, x, y, r0, r1);
        default: break;
      }
      break;
    case Target::avx2:
      switch (w.type) {
        case WeightType::f32: return gemv_rows_avx2<WeightType::f32>(w, x, y, r0, r1);
        case WeightType::f16: return gemv_rows_avx2<WeightType::f16>(w, x, y, r0, r1);
        case WeightType::bf16: return gemv_rows_avx2<WeightType::bf16>(w, x, y, r0, r1);
        default: break;
      }
      break;
    case Target::scalar: break;
  }
  gemv_rows_scalar(w, x, y, r0, r1);
}

}  // namespace

const char* gemv_target_name() {
  switch (active_target()) {
    case Target::avx512: return "avx512";
    case Target::avx2: return "avx2";
    case Target::scalar: return "scalar";
  }
  return "scalar";
}

void gemv_force_target(const std::string& name) {
  const Target best = best_target();
  Target wanted;
  if (name.empty()) {
    wanted = best;
  } else if (name == "scalar") {
    wanted = Target::scalar;
  } else if (name == "avx2") {
    wanted = Target::avx2;
  } else if (name == "avx512") {
    wanted = Target::avx512;
  } else {
    throw std::invalid_argument("gemv target '" + name + "': expected scalar, avx2 or avx512");
  }
  if (static_cast<int>(wanted) > static_cast<int>(best)) {
    throw std::invalid_argument("gemv target '" + name + "' is not supported by this CPU");
  }
  active_target() = wanted;
}

void gemv(const Matrix& w, const float* x, float* y, ThreadPool* pool) {
  // Block-quantized weights: x as int8 blocks once per call (the caller's thread-local buffer
  // grows to the widest matrix once and is then reused: no allocation per token).
  const bool blocks = is_block_type(w.type);
  thread_local qgemv::Q8Blocks caller_xq;
  qgemv::Q8Blocks& xq = caller_xq;  // a local reference: the pool's workers read the caller's blocks
  if (blocks) qgemv::quantize_activation(x, w.cols, xq, qgemv::activation_format(w.type));
  auto rows = [&](std::size_t r0, std::size_t r1) {
    if (blocks) {
      qgemv::gemv_rows(w.type, w.data, w.row_bytes(), w.cols, xq, y, r0, r1);
    } else {
      gemv_rows(w, x, y, r0, r1);
    }
  };
  // Below ~256K weights the hand-off costs more than the second core saves.
  constexpr std::size_t kParallelMinElements = 1 << 18;
  if (pool == nullptr || pool->threads() == 1 || w.rows * w.cols < kParallelMinElements) {
    rows(0, w.rows);
    return;
  }
  const int parts = pool->threads();
  // Split on multiples of 16 rows so the two halves never share a cache line of y.
  const std::size_t per = (w.rows + parts - 1) / parts;
  const std::size_t step = (per + 15) / 16 * 16;
  auto part = [&](int i) {
    const std::size_t r0 = std::min(w.rows, static_cast<std::size_t>(i) * step);
    const std::size_t r1 = std::min(w.rows, r0 + step);
    if (r0 < r1) rows(r0, r1);
  };
  pool->for_each(parts, part);
}

void gemv_multi(const Matrix* const* ws, float* const* ys, std::size_t count, const float* x, ThreadPool* pool) {
  bool fused = count > 0 && pool != nullptr && pool->threads() > 1;
  std::size_t elements = 0;
  for (std::size_t k = 0; k < count && fused; ++k) {
    fused = is_block_type(ws[k]->type) && ws[k]->cols == ws[0]->cols &&
            qgemv::activation_format(ws[k]->type) == qgemv::activation_format(ws[0]->type);
    elements += ws[k]->rows * ws[k]->cols;
  }
  // gemv's threshold: below it the hand-off costs more than the second core saves.
  constexpr std::size_t kParallelMinElements = 1 << 18;
  if (!fused || elements < kParallelMinElements) {
    for (std::size_t k = 0; k < count; ++k) gemv(*ws[k], x, ys[k], pool);
    return;
  }
  thread_local qgemv::Q8Blocks caller_xq;
  qgemv::Q8Blocks& xq = caller_xq;  // a local reference: the pool's workers read the caller's blocks
  qgemv::quantize_activation(x, ws[0]->cols, xq, qgemv::activation_format(ws[0]->type));
  const int parts = pool->threads();
  // Every matrix split as gemv splits it (multiples of 16 rows): part i takes its share of each.
  auto part = [&](int i) {
    for (std::size_t k = 0; k < count; ++k) {
      const Matrix& w = *ws[k];
      const std::size_t per = (w.rows + parts - 1) / parts;
      const std::size_t step = (per + 15) / 16 * 16;
      const std::size_t r0 = std::min(w.rows, static_cast<std::size_t>(i) * step);
      const std::size_t r1 = std::min(w.rows, r0 + step);
      if (r0 < r1) qgemv::gemv_rows(w.type, w.data, w.row_bytes(), w.cols, xq, ys[k], r0, r1);
    }
  };
  pool->for_each(parts, part);
}

namespace {

// Y[:, r0:r1] for weight rows [r0, r1): f32 weights straight to sgemm, bf16/f16 converted
// `tile_rows` rows at a time into `tile`.
void matmul_rows(const Matrix& w, const float* x, std::size_t n, float* y, float* tile, std::size_t tile_rows,
                 std::size_t r0, std::size_t r1) {
  const int rows = static_cast<int>(w.rows), cols = static_cast<int>(w.cols);
  for (std::size_t t0 = r0; t0 < r1; t0 += tile_rows) {
    const std::size_t tr = std::min(tile_rows, r1 - t0);
    const float* b = tile;
    if (w.type == WeightType::f32) {
      b = static_cast<const float*>(w.data) + t0 * w.cols;
    } else {
      convert_rows(w, t0, tr, tile);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(tr), cols, 1.0f, x,
                cols, b, cols, 0.0f, y + t0, rows);
  }
}

}  // namespace

void matmul(const Matrix& w, const float* x, std::size_t n, float* y, float* tile,
            std::size_t tile_rows, ThreadPool* pool) {
  if (n <= 2) {  // converting the whole matrix costs more than reading it twice
    for (std::size_t s = 0; s < n; ++s) gemv(w, x + s * w.cols, y + s * w.rows, pool);
    return;
  }
  if (is_block_type(w.type) && qgemv::gemm_is_packed()) {
    // Block weights on AVX-512 VNNI: int8 products over repacked 16-row tiles (quant_gemv.h), each
    // token's activation quantized once; the pool splits the rows in multiples of 16.
    thread_local std::vector<qgemv::Q8Blocks> caller_xs;
    std::vector<qgemv::Q8Blocks>& xs = caller_xs;  // a local reference: the workers read the caller's
    if (xs.size() < n) xs.resize(n);
    const qgemv::ActivationFormat format = qgemv::activation_format(w.type);
    for (std::size_t s = 0; s < n; ++s) qgemv::quantize_activation(x + s * w.cols, w.cols, xs[s], format);
    const int parts = pool != nullptr ? pool->threads() : 1;
    const std::size_t per = (w.rows + parts - 1) / parts;
    const std::size_t step = (per + 15) / 16 * 16;
    auto part = [&](int i) {
      const std::size_t r0 = std::min(w.rows, static_cast<std::size_t>(i) * step);
      const std::size_t r1 = std::min(w.rows, r0 + step);
      if (r0 < r1) qgemv::gemm_rows(w.type, w.data, w.row_bytes(), w.cols, xs.data(), n, y, w.rows, r0, r1);
    };
    if (pool != nullptr) {
      pool->for_each(parts, part);
    } else {
      part(0);
    }
    return;
  }
  const int parts = pool != nullptr ? pool->threads() : 1;
  if (parts == 1 || w.rows < 32 * static_cast<std::size_t>(parts)) {
    matmul_rows(w, x, n, y, tile, w.type == WeightType::f32 ? w.rows : tile_rows, 0, w.rows);
    return;
  }
  // The engine's pool splits the weight rows (multiples of 16: no shared cache line of y); each
  // part converts its own tiles and calls a single-threaded sgemm, so the conversion runs in
  // parallel too and no BLAS worker threads spin beside the pool's.
  const std::size_t per = (w.rows + parts - 1) / parts;
  const std::size_t step = (per + 15) / 16 * 16;
  const std::size_t part_tile = std::max<std::size_t>(1, tile_rows / static_cast<std::size_t>(parts));
  auto part = [&](int i) {
    const std::size_t r0 = std::min(w.rows, static_cast<std::size_t>(i) * step);
    const std::size_t r1 = std::min(w.rows, r0 + step);
    if (r0 >= r1) return;
    // The caller's tile split between the parts: part i owns rows [i * part_tile, (i+1) * part_tile).
    matmul_rows(w, x, n, y, tile + static_cast<std::size_t>(i) * part_tile * w.cols, part_tile, r0, r1);
  };
  pool->for_each(parts, part);
}

// ------------------------------------------------------------------------------------------------
// Elementwise kernels

void rmsnorm(float* out, const float* x, const float* weight, std::size_t n, float eps) {
  double ss = 0;
  for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (std::size_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

void softmax(float* x, std::size_t n) { kernels::softmax_inplace(x, n); }

void swiglu(float* gate, const float* up, std::size_t n) { kernels::swiglu_inplace(gate, up, n); }

// ------------------------------------------------------------------------------------------------
// RoPE

RopeTable::RopeTable(const ModelConfig& config)
    : RopeTable(config.head_dim, config.rope_theta, config.rope_scaling) {}

RopeTable::RopeTable(int head_dim, double theta, const RopeScaling& scaling) : head_dim_(head_dim) {
  if (head_dim <= 0 || head_dim % 2 != 0) {
    throw ModelFileError("config.json: head_dim " + std::to_string(head_dim) +
                         " must be positive and even for RoPE");
  }
  const int half = head_dim / 2;
  inv_freq_.resize(half);
  for (int i = 0; i < half; ++i) {
    // HF: 1 / theta^(2i / d), in fp32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq_[i] = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(exponent)));
  }
  const std::string& type = scaling.type;
  if (type == "none" || type == "default" || type.empty()) return;
  if (type == "linear") {
    for (float& f : inv_freq_) f = static_cast<float>(f / scaling.factor);
    return;
  }
  if (type == "freq_factors") {
    if (scaling.freq_factors.size() != inv_freq_.size()) {
      throw ModelFileError("rope freq_factors: " + std::to_string(scaling.freq_factors.size()) + " factors for " +
                           std::to_string(inv_freq_.size()) + " frequencies");
    }
    for (std::size_t i = 0; i < inv_freq_.size(); ++i) {
      if (!(scaling.freq_factors[i] > 0) || !std::isfinite(scaling.freq_factors[i])) {
        throw ModelFileError("rope freq_factors[" + std::to_string(i) + "] must be a positive number");
      }
      inv_freq_[i] /= scaling.freq_factors[i];  // fp32, as ggml's rope divides theta by the factor
    }
    return;
  }
  if (type == "llama3") {
    // Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    const double old_len = scaling.original_max_position_embeddings;
    if (old_len <= 0) {
      throw ModelFileError("config.json: rope_scaling.original_max_position_embeddings must be > 0 for llama3");
    }
    const double low_wavelen = old_len / scaling.low_freq_factor;
    const double high_wavelen = old_len / scaling.high_freq_factor;
    for (float& f : inv_freq_) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / scaling.factor);
        continue;
      }
      const double smooth = (old_len / wavelen - scaling.low_freq_factor) /
                            (scaling.high_freq_factor - scaling.low_freq_factor);
      f = static_cast<float>((1 - smooth) * f / scaling.factor + smooth * f);
    }
    return;
  }
  throw ModelFileError("config.json: rope_scaling type '" + type +
                       "' is not supported (expected default, linear or llama3)");
}

void RopeTable::angles(std::int64_t position, float* cos_out, float* sin_out) const {
  const float pos = static_cast<float>(position);
  for (std::size_t i = 0; i < inv_freq_.size(); ++i) {
    const float angle = pos * inv_freq_[i];  // fp32 product, as HF's matmul of positions and freqs
    cos_out[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin_out[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void rope_rotate(float* x, const float* cos, const float* sin, std::size_t head_dim) {
  const std::size_t half = head_dim / 2;
  for (std::size_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace kvslim::engine
