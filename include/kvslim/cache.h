// The per-layer cache contract. A cache stores what a layer has seen (in whatever form its method
// keeps: fp16 slots, bit-packed groups) and computes attention over that storage itself:
//
//   cache.append(keys, values, positions);            // absorb a block of new K/V
//   cache.attend(queries, query_positions, out, probs);  // attention over what is kept
//
// so a compressed cache is read compressed (storage type and attention kernel belong together, as
// in llama.cpp). The fp16 rows are still available through `materialize()` (tests, debugging,
// integrators who want rows), which decodes into the layer's own scratch and is off the decode path;
// `update_and_fetch` = append + materialize is the original system's call shape.
//
// Threading rule: the layers of one CacheSet are independent objects. Different layers may be used
// at the same time from different threads (engines that run layers of different sequences in
// parallel); a layer changes only inside calls on that layer (a squeeze layer adopts the schedule
// another layer finalised at its own next append/observe). Calls on ONE layer must not overlap,
// except attend, stats, rows and needs, which may run concurrently with each other (never with
// another call on that layer). materialize()/view() write the layer's scratch: they count as
// mutating calls of that layer.
// CacheSet::reset() touches every layer: nothing else of that set may run during it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvslim/block.h"

namespace kvslim {

// The kept rows as fp16 (materialize): `tokens` rows per (batch, head), in the cache's row order --
// the order attend's probabilities and the attention observation use. Rows are NOT in position
// order after evictions (an evicted slot is reused); `positions` gives the absolute position of
// every row. The view stays valid until the next non-const call on the same cache (append,
// update_and_fetch, materialize/view of a compressed cache, observe_*, reset); other layers never
// invalidate it.
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
  // 0: every query of a step is read. n: only the last n queries of a step with more are read (an
  // observation window), so the engine may observe just those: a 32k-token prompt's observation
  // is then [H_kv, n, rows] instead of [H_kv, 32k, rows] (34 GB at 8 KV heads).
  std::size_t attention_queries = 0;
};

// Attention probabilities of one step of one layer, summed over the query heads of each KV group:
// probs[((b * heads + h) * queries + q) * stride + i] is the weight query q gave row i of the cache
// (its row order: materialize(), attend's probs) as it was after the last append (tokens = rows()).
// attend(..., probs) writes exactly this layout with stride = rows(), so its output can be passed
// straight back.
struct AttentionObservation {
  const float* probs = nullptr;
  std::size_t batch = 0, heads = 0, queries = 0, tokens = 0, stride = 0;
  std::span<const std::int64_t> query_positions;  // absolute positions of the queries (host memory)
  // Where probs live: a device cache's own attend leaves them in its GPU's memory, ordered on
  // `stream` (a cudaStream_t). A CPU cache takes host probs only (InputError otherwise).
  MemorySpace space = MemorySpace::host;
  void* stream = nullptr;
};

// Hidden states of one layer before attention (the residual stream) and after attention plus the
// residual add, [batch, tokens, hidden] fp32.
struct HiddenObservation {
  const float* before = nullptr;
  const float* after = nullptr;
  std::size_t batch = 0, tokens = 0, hidden = 0;
};

// Queries of one attention call: fp32 [batch, tokens, heads, head_dim] (the token-major layout of
// a Q projection). `heads` must be a multiple of the cache's KV heads: query head j uses KV head
// j / (heads / kv_heads) (grouped-query attention; heads == kv_heads is plain multi-head).
struct QueryBlock {
  const float* data = nullptr;
  std::size_t batch = 0, tokens = 0, heads = 0, head_dim = 0;
  float scale = 0.0f;  // logit scale; 0 = 1 / sqrt(head_dim)
  // As KVBlock: where data (and attend's out / probs) live, and the CUDA stream to order on.
  MemorySpace space = MemorySpace::host;
  void* stream = nullptr;
};

// Runs task(i) for every i < n, in any order, possibly on several threads, and returns when all
// are done. attend splits its work into independent (batch, KV head) tasks; without one it runs
// them on the calling thread.
using ParallelFor = std::function<void(std::size_t n, const std::function<void(std::size_t)>& task)>;

class KVCache {
 public:
  virtual ~KVCache() = default;

  // Absorbs a block of new keys and values, [B, H_kv, S, D] each (same shape and dtype), whose
  // absolute positions are `positions` (S values, increasing; empty: continue after the last
  // position seen, starting at 0). Throws InputError on a wrong shape, a change of B/H/D, NaN or
  // infinite values, or positions that go backwards; on error nothing is changed.
  virtual void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions = {}) = 0;

  // Attention of `queries` over the rows this cache keeps, computed from its own storage:
  //   out[b, s, j, :] = sum_i softmax_i(scale * q[b,s,j] . K[b,g,i]) V[b,g,i],  g = j / group,
  // over the rows i whose position is <= query_positions[s] (causal by true position; evicted
  // rows are simply absent). out: fp32 [batch, tokens, heads, head_dim]. A query that sees no row
  // gets zeros. When `probs` is non-null it receives the probabilities summed over the query heads
  // of each KV head, fp32 [batch, kv_heads, tokens, rows()] in the cache's row order (the
  // AttentionObservation layout with stride rows(); zeros for masked rows). Results equal fp32
  // attention over materialize()'s rows to fp16 rounding. Throws InputError when batch/head_dim
  // differ from the stored ones, heads is not a multiple of the KV heads, or the position count is
  // not tokens. Before the first append, out is zero-filled.
  virtual void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                      float* probs = nullptr, const ParallelFor* parallel = nullptr) const = 0;

  // Rows kept per (batch, KV head): what attend covers and materialize returns.
  virtual std::size_t rows() const = 0;

  // The kept rows as fp16 (an adapter for tests, tools and integrators; not used by attend).
  // Compressed caches decode into this layer's own scratch (counted in stats().view_bytes), so
  // the call is not free and invalidates this layer's previous view.
  virtual CacheView materialize() const = 0;

  // The original system's call: append, then the fp16 view of what is kept.
  CacheView update_and_fetch(const KVBlock& keys, const KVBlock& values,
                             std::span<const std::int64_t> positions = {}) {
    append(keys, values, positions);
    return materialize();
  }
  // materialize() under its old name (empty before the first append).
  CacheView view() const { return materialize(); }

  virtual CacheStats stats() const = 0;
  // Forgets every token (a new sequence). A squeeze layer keeps the schedule its set finalised
  // (the set's CacheSet::reset() clears that too).
  virtual void reset() = 0;
  // A hint: this layer will be given at most `tokens` tokens in all (prompt plus generated). A
  // cache that keeps every token (full) allocates for them at its first append instead of growing
  // x1.5 as it fills (each growth copies the whole store); bounded caches ignore it. The
  // reservation counts in stats().resident_bytes, as llama.cpp's n_ctx-sized cache does.
  virtual void reserve(std::size_t tokens) { (void)tokens; }

  virtual ObservationNeeds needs() const { return {}; }
  // Attention-scored methods evict here. If an engine forgets to call it, the next append still
  // holds the budget (it evicts by the scores observed so far), so memory stays bounded.
  virtual void observe_attention(const AttentionObservation&) {}
  virtual void observe_hidden(const HiddenObservation&) {}
  // An attention step whose probabilities nobody but the cache reads (an engine's layer step):
  // attend(queries, query_positions, out, probs), then, when needs().attention, observe_attention
  // of them ([batch, kv_heads, tokens, rows()], stride rows()). probs: the caller's workspace of
  // that shape in the queries' memory space; its contents afterwards are unspecified (a device
  // cache's decode step may score each row inside its observation, from the attention's logits,
  // and never write them). A cache that observes nothing attends without probabilities.
  virtual void attend_and_observe(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                                  float* probs, std::size_t kv_heads, const ParallelFor* parallel = nullptr);

  virtual std::string_view method() const = 0;
  int layer_id() const { return layer_id_; }
  void set_layer_id(int id) { layer_id_ = id; }

 private:
  int layer_id_ = -1;
};

}  // namespace kvslim
