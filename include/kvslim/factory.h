// Building caches: one lone layer (KVCacheFactory) or every layer of a model with the shared
// machinery per-layer methods need (KVCacheBuilder -> CacheSet).
#pragma once
#include <memory>
#include <vector>

#include "kvslim/cache.h"
#include "kvslim/config.h"
#include "kvslim/rank_gather.h"

namespace kvslim {

struct LayerSpec {
  bool attention = true;  // false: the layer has no KV cache (its CacheSet slot is null)
  int kv_heads = 0;
  int head_dim = 0;
};

struct ModelSpec {
  std::vector<LayerSpec> layers;
  static ModelSpec uniform(int n_layers, int kv_heads, int head_dim);
};

class SqueezeCoordinator;
class CrossLayerImportance;

// The caches of one model, one per layer (null for layers without attention), and what they share.
class CacheSet {
 public:
  CacheSet() = default;
  CacheSet(CacheSet&&) noexcept = default;
  CacheSet& operator=(CacheSet&&) noexcept = default;
  ~CacheSet();
  // A set assembled by the caller, one cache per layer (null: a layer without attention): caches
  // of its own or wrappers of built ones. Nothing is shared between its layers but what they share.
  static CacheSet of_layers(std::vector<std::unique_ptr<KVCache>> layers);

  std::size_t size() const { return caches_.size(); }
  KVCache* operator[](std::size_t layer) const { return caches_[layer].get(); }
  KVCache& at(std::size_t layer) const;  // throws std::out_of_range for a missing/non-attention layer
  // Forgets every token in every layer and resets the shared coordinator (the original never does).
  void reset();
  // KVCache::reserve(tokens) on every layer: the run's length, when the caller knows it.
  void reserve(std::size_t tokens);
  // Sum over layers of stats().resident_bytes (plus the cross-layer board while a prefill call
  // holds it: nothing between calls) / seen_fp16_bytes.
  std::size_t resident_bytes() const;
  std::size_t seen_fp16_bytes() const;
  const SqueezeCoordinator* coordinator() const { return coordinator_.get(); }
  // Tensor parallelism: this set holds a slice of every layer's KV heads, the other ranks the rest.
  // What its layers decide from statistics over a layer's heads (squeeze's schedule, the
  // cross-layer board) then goes through `gather`, so every rank decides what one process over all
  // heads would (docs/distributed.md). Set before the first update; null = this process alone.
  void set_rank_gather(std::shared_ptr<RankGather> gather);
  bool needs_rank_gather() const { return coordinator_ != nullptr || importance_ != nullptr; }

 private:
  friend class KVCacheBuilder;
  std::vector<std::unique_ptr<KVCache>> caches_;
  std::shared_ptr<SqueezeCoordinator> coordinator_;
  std::shared_ptr<CrossLayerImportance> importance_;  // h2o / squeeze / pyramidkv with evict_cross_layer > 0
};

class KVCacheFactory {
 public:
  // A lone cache (no coordinator: squeeze behaves as a uniform-budget H2O layer). Validates first.
  static std::unique_ptr<KVCache> create(const KVCacheConfig& config);
};

class KVCacheBuilder {
 public:
  // One cache per attention layer with head_dim and seed set per layer; squeeze layers share one
  // SqueezeCoordinator; pyramidkv layers get their taper; the layers of an H2O-core method with
  // evict_cross_layer > 0 share one CrossLayerImportance. Validates before building anything.
  static CacheSet for_model(const ModelSpec& model, const KVCacheConfig& config);
};

}  // namespace kvslim
