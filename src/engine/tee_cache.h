// One stream of appends and observations fed to several caches at once. The first cache (the
// primary) answers attend / materialize / rows / stats, so the engine runs the model once and each
// follower absorbs what its own prefill would have given it: for a prompt run as one call into
// empty caches the followers see the same keys, values and positions, and (when they observe
// attention) the primary's probabilities over the same rows in the same order -- exactly what an
// eviction cache's own prefill observes, since it attends over every prompt row before it evicts.
// A compressed follower (kivi, zipcache) would have attended over its own dequantised rows, and
// streaming over the window it keeps after the append, so their later layers' keys differ from
// their own prefill's (by rounding for the compressed ones). For timing decode that is immaterial:
// the cache holds as many rows in the same format.
//
// `kvslim bench engine --shared-prefill` uses it to fill several methods at a long context with
// one prefill (a 32k-token prefill of a 16-layer model takes over 20 minutes on 2 cores).
#pragma once
#include <string>
#include <vector>

#include "kvslim/cache.h"
#include "kvslim/factory.h"

namespace kvslim::engine {

class TeeCache final : public KVCache {
 public:
  // Non-owning: the caches must outlive the tee. primary and every follower non-null.
  TeeCache(KVCache* primary, std::vector<KVCache*> followers);

  void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions = {}) override;
  void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
              float* probs = nullptr, const ParallelFor* parallel = nullptr) const override;
  std::size_t rows() const override { return primary_->rows(); }
  CacheView materialize() const override { return primary_->materialize(); }
  CacheStats stats() const override { return primary_->stats(); }
  void reset() override;
  void reserve(std::size_t tokens) override;
  // The union: attention when any cache observes it, over the most trailing queries any reads.
  ObservationNeeds needs() const override;
  // Forwarded to each cache that observes attention; throws std::logic_error when such a cache
  // does not keep exactly the primary's rows (the probabilities are over the primary's rows).
  void observe_attention(const AttentionObservation& observation) override;
  void observe_hidden(const HiddenObservation& observation) override;
  std::string_view method() const override { return name_; }

 private:
  void check_same_rows(const KVCache& follower) const;

  KVCache* primary_;
  std::vector<KVCache*> all_;  // primary first, then the followers
  std::string name_;
};

// One TeeCache per layer over `primary`'s cache and each follower set's cache of that layer. The
// sets must have the same layers and outlive the result.
CacheSet tee_cache_set(const CacheSet& primary, const std::vector<const CacheSet*>& followers);

}  // namespace kvslim::engine
