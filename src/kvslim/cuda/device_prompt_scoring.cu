#include "cuda/device_prompt_scoring.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "cuda/cuda_common.cuh"
#include "cuda/kernel_launch.h"

namespace kvslim::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kNoLayer = 0xFFFFFFFFu;

// The lowest flat index [heads, Q, rows] of a non-finite probability into *first (LLONG_MAX: none).
__global__ void nonfinite_kernel(PromptWindow w, unsigned long long* first) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= w.rows) return;
  const long long vectors = static_cast<long long>(w.heads) * w.Q;  // head * Q + q
  for (long long vec = blockIdx.y; vec < vectors; vec += gridDim.y) {
    if (!isfinite(w.probs[vec * w.probs_stride + i])) atomicMin(first, static_cast<unsigned long long>(vec * w.rows + i));
  }
}

// Per row: the window's contribution summed from the last query back, each query's weight
// decay^(queries after it), exposure counting the queries that could see the row
// (observation_contribution); stored as pooling reads it (the mean per query when normalised).
__global__ void contribution_kernel(PromptWindow w, PromptRows r, float* contrib, float* seen) {
  const int head = blockIdx.y;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= w.rows) return;
  const std::int64_t p = r.pos[head * r.stride + i];
  float c = 0.f, e = 0.f, weight = 1.f;
  for (int q = w.Q - 1; q >= w.first; --q) {
    const float x = w.probs[(static_cast<long long>(head) * w.Q + q) * w.probs_stride + i];
    c = weight == 1.f ? __fadd_rn(c, x) : __fadd_rn(c, __fmul_rn(weight, x));
    if (w.normalized) {
      const std::int64_t qp = w.qpos != nullptr ? w.qpos[q] : LLONG_MAX;
      e = __fadd_rn(e, p <= qp ? weight : 0.f);
    }
    weight = __fmul_rn(weight, w.decay);
  }
  const bool pools = w.pool_half > 0 && w.Q >= 2 && w.rows >= 2;
  const long long at = static_cast<long long>(head) * w.rows + i;
  contrib[at] = pools && w.normalized ? (e > 0.f ? __fdiv_rn(c, e) : 0.f) : c;
  seen[at] = e;
}

// Per row: the max over the pool_half rows each side (rows in position order), weighed back by the
// exposure when normalised, into the score (a first prompt's rows held 0); then the board's share
// (another layer's importance as attention these queries paid) and this layer's post.
__global__ void pool_exchange_kernel(PromptWindow w, PromptRows r, const float* contrib, const float* seen,
                                     DeviceImportanceBoard::View b, bool exchange) {
  const int head = blockIdx.y;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= w.rows) return;
  const long long row0 = static_cast<long long>(head) * w.rows;
  const float e = seen[row0 + i];
  float pooled = contrib[row0 + i];
  if (w.pool_half > 0 && w.Q >= 2 && w.rows >= 2) {
    float m = 0.f;
    const long long lo = i > w.pool_half ? i - w.pool_half : 0;
    const long long hi = min(static_cast<long long>(w.rows) - 1, i + w.pool_half);
    for (long long t = lo; t <= hi; ++t) m = fmaxf(m, contrib[row0 + t]);
    pooled = w.normalized ? __fmul_rn(m, e) : m;
  }
  float score = pooled;
  if (exchange) {
    const float s = w.normalized ? e : static_cast<float>(w.Q - w.first);
    const std::int64_t p = r.pos[head * r.stride + i];
    const long long k = static_cast<long long>(head / w.heads_per_row) * w.rows + (p - b.p0);
    const float other = b.best_layer[k] == b.layer ? b.second[k] : b.best[k];
    score = __fadd_rn(score, __fmul_rn(__fmul_rn(b.weight, other), s));
    const float own = s > 0.f ? __fdiv_rn(pooled, s) : 0.f;
    atomicMax(b.pending + k, __float_as_uint(own));  // own >= +0: its bits order as the values
  }
  r.score[head * r.stride + i] = score;
  if (r.expo != nullptr) r.expo[head * r.stride + i] = e;
}

// One layer's posts (the max over its heads) into the board, as CrossLayerImportance::merge_locked.
__global__ void board_merge_kernel(DeviceImportanceBoard::View b, long long n) {
  const long long k = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  const float v = __uint_as_float(b.pending[k]);
  if (b.best_layer[k] == b.layer) {
    b.best[k] = fmaxf(b.best[k], v);
  } else if (v > b.best[k]) {
    b.second[k] = b.best[k];
    b.best[k] = v;
    b.best_layer[k] = b.layer;
  } else {
    b.second[k] = fmaxf(b.second[k], v);
  }
  b.pending[k] = 0u;
}

__global__ void board_clear_kernel(float* best, float* second, unsigned* best_layer, unsigned* pending, long long n) {
  const long long k = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  best[k] = 0.f;
  second[k] = 0.f;
  best_layer[k] = kNoLayer;
  pending[k] = 0u;
}

unsigned blocks_for(long long n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

DeviceImportanceBoard::View DeviceImportanceBoard::begin(std::size_t call, unsigned layer, float weight,
                                                         std::size_t batch_rows, std::size_t rows, std::int64_t p0,
                                                         cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!started_ || call > call_) {
    // A new prefill call: the last call's importance was added to the scores it concerned.
    const std::size_t n = batch_rows * rows;
    for (DeviceBuffer* b : {&best_, &second_, &best_layer_, &pending_}) b->reserve(std::max<std::size_t>(n, 1) * 4, stream);
    launch_kernel(n > 0, false, board_clear_kernel, dim3(blocks_for(static_cast<long long>(n))), dim3(kThreads), 0, stream,
                  best_.as<float>(), second_.as<float>(), best_layer_.as<unsigned>(), pending_.as<unsigned>(),
                  static_cast<long long>(n));
    started_ = true;
    posted_ = false;
    call_ = call;
    batch_rows_ = batch_rows;
    rows_ = rows;
    p0_ = p0;
  } else if (call < call_ || batch_rows != batch_rows_ || rows != rows_ || p0 != p0_) {
    throw std::logic_error("cross-layer board (cuda): layer " + std::to_string(layer) + "'s prompt (call " +
                           std::to_string(call) + ", " + std::to_string(batch_rows) + " x " + std::to_string(rows) +
                           " positions from " + std::to_string(p0) + ") is not the call the board holds (call " +
                           std::to_string(call_) + ", " + std::to_string(batch_rows_) + " x " + std::to_string(rows_) +
                           " from " + std::to_string(p0_) + ")");
  }
  posted_ = true;
  return View{best_.as<float>(), second_.as<float>(), best_layer_.as<unsigned>(), pending_.as<unsigned>(), p0, layer, weight};
}

void DeviceImportanceBoard::merge(const View& v, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const long long n = static_cast<long long>(batch_rows_ * rows_);
  launch_kernel(n > 0, false, board_merge_kernel, dim3(blocks_for(n)), dim3(kThreads), 0, stream, v, n);
}

void DeviceImportanceBoard::discard(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_.get() != nullptr) KVSLIM_CUDA_CHECK(cudaMemsetAsync(pending_.get(), 0, batch_rows_ * rows_ * 4, stream));
}

bool DeviceImportanceBoard::holds_call(std::size_t call) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return started_ && posted_ && call_ == call;
}

long long first_nonfinite_probability(const PromptWindow& w, cudaStream_t stream) {
  if (w.rows <= 0 || w.heads <= 0 || w.Q <= 0) return -1;
  DeviceBuffer first;
  first.reserve(sizeof(unsigned long long), stream);
  const unsigned long long none = ~0ull;
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(first.get(), &none, sizeof(none), cudaMemcpyHostToDevice, stream));
  const long long vectors = static_cast<long long>(w.heads) * w.Q;
  launch_kernel(true, false, nonfinite_kernel, dim3(blocks_for(w.rows), static_cast<unsigned>(std::min(vectors, 65535LL))),
                dim3(kThreads), 0, stream, w, first.as<unsigned long long>());
  unsigned long long at = none;
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(&at, first.get(), sizeof(at), cudaMemcpyDeviceToHost, stream));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return at == none ? -1 : static_cast<long long>(at);
}

void launch_prompt_scoring(const PromptWindow& w, const PromptRows& rows, const DeviceImportanceBoard::View* board,
                           float* scratch, cudaStream_t stream) {
  if (w.rows <= 0 || w.heads <= 0) return;
  float* contrib = scratch;
  float* seen = scratch + static_cast<long long>(w.heads) * w.rows;
  const dim3 grid(blocks_for(w.rows), static_cast<unsigned>(w.heads));
  launch_kernel(true, false, contribution_kernel, grid, dim3(kThreads), 0, stream, w, rows, contrib, seen);
  launch_kernel(true, false, pool_exchange_kernel, grid, dim3(kThreads), 0, stream, w, rows,
                static_cast<const float*>(contrib), static_cast<const float*>(seen),
                board != nullptr ? *board : DeviceImportanceBoard::View{}, board != nullptr);
}

}  // namespace kvslim::cuda
