// The per-layer cache contract: the C++ shape of the original update_and_fetch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvslim/block.h"

namespace kvslim {

// What a layer attends over after an update: `tokens` rows per (batch, head), as fp16.
// Rows are NOT in position order after evictions (an evicted slot is reused); `positions` gives
// the absolute position of every row. The view stays valid until the next mutating call on the
// cache (update_and_fetch, observe_*, reset) or on another cache of the same CacheSet.
struct CacheView {
  std::size_t batch = 0, heads = 0, tokens = 0, head_dim = 0;
  std::size_t head_stride = 0;              // rows between consecutive (b, h) heads
  const std::uint16_t* keys = nullptr;      // fp16 [batch * heads, head_stride, head_dim]
  const std::uint16_t* values = nullptr;    // fp16 [batch * heads, head_stride, head_dim]
  const std::int64_t* positions = nullptr;  // [batch * heads, head_stride]

  std::size_t head_index(std::size_t b, std::size_t h) const { return b * heads + h; }
  const std::uint16_t* key_row(std::size_t b, std::size_t h, std::size_t i) const {
    return keys + (head_index(b, h) * head_stride + i) * head_dim;
  }
  const std::uint16_t* value_row(std::size_t b, std::size_t h, std::size_t i) const {
    return values + (head_index(b, h) * head_stride + i) * head_dim;
  }
  std::int64_t position(std::size_t b, std::size_t h, std::size_t i) const {
    return positions[head_index(b, h) * head_stride + i];
  }
};

// Statistics every cache reports, for every head (the original reports head (0, 0) only).
struct CacheStats {
  std::string method;
  std::size_t batch = 0, heads = 0, head_dim = 0;
  std::uint64_t tokens_seen = 0;              // tokens absorbed per head
  std::vector<std::size_t> kept_per_head;     // [batch * heads]
  std::size_t tokens_kept = 0;                // kept per head (equal for every head)
  std::size_t resident_bytes = 0;             // bytes really allocated for the retained state
  std::size_t view_bytes = 0;                 // scratch for the fp16 view, when not the state itself
  std::size_t kept_fp16_bytes = 0;            // what the kept tokens would take as fp16 K+V
  std::size_t seen_fp16_bytes = 0;            // what every seen token would take as fp16 K+V
  double accounted_bytes = -1;                // the original system's accounted bytes (-1: n/a)
  double compression_ratio = 1.0;             // seen_fp16_bytes / resident_bytes (1 when empty)
  std::vector<std::pair<std::string, double>> figures;  // method's own (layer_budget, ...)

  // The named method figure; throws std::out_of_range naming it when absent.
  double figure(std::string_view name) const;
  bool has_figure(std::string_view name) const;
};

// What a cache wants the engine to report through the observation hook. Engines skip the work
// for signals nobody asked for.
struct ObservationNeeds {
  bool attention = false;      // observe_attention after every attention step of this layer
  bool hidden_states = false;  // observe_hidden during prefill
};

// Attention probabilities of one step of one layer, summed over the query heads of each KV group:
// probs[((b * heads + h) * queries + q) * stride + i] is the weight query q gave row i of the view
// returned by the last update_and_fetch (tokens = that view's tokens).
struct AttentionObservation {
  const float* probs = nullptr;
  std::size_t batch = 0, heads = 0, queries = 0, tokens = 0, stride = 0;
  std::span<const std::int64_t> query_positions;  // absolute positions of the queries
};

// Hidden states of one layer before attention (the residual stream) and after attention plus the
// residual add, [batch, tokens, hidden] fp32.
struct HiddenObservation {
  const float* before = nullptr;
  const float* after = nullptr;
  std::size_t batch = 0, tokens = 0, hidden = 0;
};

class KVCache {
 public:
  virtual ~KVCache() = default;

  // Absorbs a block of new keys and values, [B, H_kv, S, D] each (same shape and dtype), whose
  // absolute positions are `positions` (S values, increasing; empty: continue after the last
  // position seen, starting at 0). Returns the view the layer attends over. Throws InputError on
  // a wrong shape, a change of B/H/D, NaN or infinite values, or positions that go backwards.
  virtual CacheView update_and_fetch(const KVBlock& keys, const KVBlock& values,
                                     std::span<const std::int64_t> positions = {}) = 0;
  // The current view without absorbing anything (empty before the first update).
  virtual CacheView view() const = 0;
  virtual CacheStats stats() const = 0;
  // Forgets every token (a new sequence).
  virtual void reset() = 0;

  virtual ObservationNeeds needs() const { return {}; }
  virtual void observe_attention(const AttentionObservation&) {}
  virtual void observe_hidden(const HiddenObservation&) {}

  virtual std::string_view method() const = 0;
  int layer_id() const { return layer_id_; }
  void set_layer_id(int id) { layer_id_ = id; }

 private:
  int layer_id_ = -1;
};

}  // namespace kvslim
