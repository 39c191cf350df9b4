// A prompt's eviction scored on the device (h2o, pyramidkv over fp16 slots or kivi codes): the
// eviction core's observe() for a multi-query observation -- observation_contribution (the
// window's last queries, decay, exposure), the max-pooling over position neighbours and the
// cross-layer exchange (src/kvslim/cache/eviction_core.cc) -- computed from the device's own
// probabilities into the store's score mirrors, so that the store's drop_lowest_on_device chooses
// the rows that leave. Nothing [heads, queries, rows] crosses to the host, and no row's metadata.
//
// Every product, quotient and sum is rounded as the core rounds it (no contraction, the same order
// over queries), so the device keeps the CPU cache's rows bit for bit. Taken for a prompt into an
// empty cache whose positions ascend one by one (a sequence's first prefill: the decision that
// cost seconds on the host at 16 x 32k); everything else is decided on the host.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "cuda/device_buffer.h"

namespace kvslim::cuda {

// A store's rows for the prompt's scoring: head h's row i at h * stride + i, in position order.
struct PromptRows {
  float* score = nullptr;
  float* expo = nullptr;  // attention_normalized only, else null
  const std::int64_t* pos = nullptr;
  long long stride = 0;
};

// The observation: probabilities [heads, Q, probs_stride] (this cache's attend, device memory).
struct PromptWindow {
  const float* probs = nullptr;
  long long probs_stride = 0;
  int heads = 0;              // batch x KV heads
  int heads_per_row = 1;      // KV heads of one batch row (the board is per batch row)
  int Q = 0, first = 0;       // queries; the first of the observation window (the core's obs_window)
  const std::int64_t* qpos = nullptr;  // device [Q]; null: every query sees every row
  float decay = 1.f;
  bool normalized = false;    // attention_normalized: exposure kept, pooling over the mean
  int pool_half = 0;          // pool_kernel / 2; 0: no pooling
  int rows = 0;
};

// The cross-layer board of one model's device caches (CrossLayerImportance's attachment) for the
// current prefill call: per batch row and position p0 + k, the largest importance any layer posted
// (best, with best_layer) and the largest of the other layers (second), as the host board keeps
// them; a layer's own posts wait in `pending` (max over its heads) until it merges them.
class DeviceImportanceBoard {
 public:
  struct View {
    float* best = nullptr;
    float* second = nullptr;
    unsigned* best_layer = nullptr;
    unsigned* pending = nullptr;  // float bits (values >= 0 order as unsigned)
    std::int64_t p0 = 0;
    unsigned layer = 0;
    float weight = 0.f;  // policy cross_layer
  };
  // Layer `layer` scores call `call` over batch_rows x rows positions from p0. A new call clears the
  // board (on `stream`). Throws std::logic_error when layers of one call disagree on the positions.
  View begin(std::size_t call, unsigned layer, float weight, std::size_t batch_rows, std::size_t rows, std::int64_t p0,
             cudaStream_t stream);
  // The layer's pending posts join the board (after its scoring, on the same stream).
  void merge(const View& v, cudaStream_t stream);
  // A failed scoring's posts dropped (the layer leaves without publishing).
  void discard(cudaStream_t stream);
  // Whether a layer posted on this board in call `call` (a host decision of that call would miss them).
  bool holds_call(std::size_t call) const;

 private:
  mutable std::mutex mutex_;
  bool started_ = false, posted_ = false;
  std::size_t call_ = 0, batch_rows_ = 0, rows_ = 0;
  std::int64_t p0_ = 0;
  DeviceBuffer best_, second_, best_layer_, pending_;  // [batch_rows, rows] each
};

// The first non-finite probability among the observation's rows (a flat index into [heads, Q, rows],
// -1: none): read back (waits), so that a bad observation changes nothing, as on the host.
long long first_nonfinite_probability(const PromptWindow& w, cudaStream_t stream);

// Scores each row: score = the window's (pooled) contribution plus the board's share, exposure
// (normalized); posts the layer's importance to the board's pending (board null: no exchange).
// scratch: 2 x heads x rows floats.
void launch_prompt_scoring(const PromptWindow& w, const PromptRows& rows, const DeviceImportanceBoard::View* board,
                           float* scratch, cudaStream_t stream);

}  // namespace kvslim::cuda
