// Cross-layer token importance: what the prefill queries of each layer attended to, shared by the
// H2O-core layers of one model, so that a layer also keeps the tokens other layers' queries needed.
//
// Why: a layer's own prefill queries do not predict every query that will reach it. On
// models/tiny the question's queries find the pass key in layers 4-5, but the decode steps that
// copy its later digits read it in layers 7-10, where the question never looked at it; each layer
// scoring alone drops it there (passkey 0.82 at 25 % of the bytes; 1.00 with this board,
// docs/results.md table G). A token that some layer's queries needed is worth keeping everywhere.
//
// Protocol: each layer's n-th multi-query observation (a prefill call) joins call n, reads for its
// rows the largest importance any OTHER layer posted in that call (layers observed before it:
// the engine runs layers in order), posts its own, and leaves. A layer's posts wait in a pending
// list and join the board when it leaves (reads exclude the layer's own posts, so nothing it reads
// changes): under tensor parallelism (set_rank_gather) that is where every rank's posts of the
// layer are gathered, so every rank's board holds the maximum over ALL heads, as one process's.
// When every layer has left, the storage is released: between prefill calls the board holds
// nothing (decode never uses it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kvslim/rank_gather.h"

namespace kvslim {

class CrossLayerImportance {
 public:
  explicit CrossLayerImportance(std::size_t layers) : layers_(layers), left_(layers, 0) {}

  // Layer `layer` (0-based ordinal among the sharing layers) starts its observation number `call`
  // (0-based count of its multi-query observations). False when the board has already moved on
  // to a later call (this layer lags behind the others): it must then neither read nor post.
  bool join(std::size_t layer, std::size_t call);
  // out[i] = the largest importance a layer other than `layer` posted for positions[i] of batch
  // row `batch_row` in the current call (0 if none). positions ascending.
  void read(std::size_t layer, std::size_t batch_row, const std::int64_t* positions, std::size_t n, float* out) const;
  // Records `values[i]` as `layer`'s importance of positions[i] (ascending); a layer that posts a
  // position twice (one post per KV head) keeps the larger value. Visible once the layer leaves.
  void post(std::size_t layer, std::size_t batch_row, const std::int64_t* positions, const float* values, std::size_t n);
  // The layer's posts join the board (every rank's, through the rank gather: a collective). An
  // observation that failed leaves with publish = false: its posts are dropped, nothing gathered.
  void leave(std::size_t layer, bool publish = true);
  // Tensor parallelism: this board's layers hold a slice of the heads; null = this process alone.
  void set_rank_gather(std::shared_ptr<RankGather> gather);
  void reset();
  std::size_t bytes() const;
  // Whether a layer's posts are gathered over ranks when it leaves (set_rank_gather).
  bool gathers() const;
  // Whether the board holds posts of the current call (a layer left with something to publish).
  bool holds_posts() const;
  // State kept beside the board by layers that post elsewhere (the device eviction caches' board in
  // GPU memory, device_prompt_scoring.h): made by `make` on the first call, then the same object for
  // every layer that asks. Lives as long as the board.
  std::shared_ptr<void> attachment(const std::function<std::shared_ptr<void>()>& make);

 private:
  struct Entry {
    std::int64_t position;
    float best;             // the largest value any layer posted
    float second;           // the largest value a layer other than best_layer posted
    std::uint32_t best_layer;
  };
  void clear_storage();
  // Merges one layer's (batch row, position, value) posts into the board (caller holds mutex_).
  void merge_locked(std::uint32_t layer, std::vector<std::vector<std::pair<std::int64_t, float>>>& rows);

  mutable std::mutex mutex_;
  std::size_t layers_;
  bool started_ = false;
  std::size_t call_ = 0;                     // the call the board holds
  std::vector<char> left_;                   // [layers] left the current call
  std::vector<std::vector<Entry>> entries_;  // [batch rows][positions seen, ascending]
  std::vector<Entry> merged_;                // merge scratch
  // [layers][batch rows] (position, value) posts not yet on the board: a layer's, until it leaves
  std::vector<std::vector<std::vector<std::pair<std::int64_t, float>>>> pending_;
  std::shared_ptr<RankGather> gather_;
  std::shared_ptr<void> attachment_;
};

// A cache whose eviction core takes part in the exchange (KVCacheBuilder hands each the model's
// board): the CPU's EvictionCache and the device eviction cache (cuda/device_eviction_cache.h).
class SharesImportance {
 public:
  // This cache is sharing layer number `layer` (its ordinal among the attention layers).
  virtual void share_importance(std::shared_ptr<CrossLayerImportance> board, std::size_t layer) = 0;

 protected:
  ~SharesImportance() = default;
};

}  // namespace kvslim
