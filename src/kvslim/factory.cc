// Building caches: validate first, then one cache per attention layer with what it shares.
#include "kvslim/factory.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cache/cross_layer_importance.h"
#include "cache/eviction_cache.h"
#include "method_table.h"
#include "kvslim/cuda.h"
#include "kvslim/errors.h"
#include "kvslim/squeeze.h"

namespace kvslim {
namespace {

// One cache per method: the registry's builder (methods.cc); the eviction methods (full,
// streaming, h2o, pyramidkv, squeeze) are policies over the row storage the config names.
std::unique_ptr<KVCache> make_method_cache(const KVCacheConfig& c, const LayerContext& ctx) {
  std::unique_ptr<KVCache> cache;
  if (c.device_index() >= 0) {
    cache = cuda::make_cache(c, ctx.budget.value_or(-1), ctx.coordinator, ctx.layer_id);
  } else if (const MethodBuilder build = method_builder(c.method)) {
    cache = build(c, ctx);
  }
  if (!cache) throw ConfigError("KVCacheConfig.method = \"" + c.method + "\": no cache is built for this method");
  cache->set_layer_id(ctx.layer_id);
  return cache;
}

}  // namespace

ModelSpec ModelSpec::uniform(int n_layers, int kv_heads, int head_dim) {
  ModelSpec spec;
  spec.layers.assign(static_cast<std::size_t>(n_layers), LayerSpec{true, kv_heads, head_dim});
  return spec;
}

std::unique_ptr<KVCache> KVCacheFactory::create(const KVCacheConfig& config) {
  config.validate();
  return make_method_cache(config, LayerContext{});
}

CacheSet KVCacheBuilder::for_model(const ModelSpec& model, const KVCacheConfig& config) {
  config.validate();
  std::vector<int> attention_layers;
  for (std::size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& l = model.layers[i];
    if (!l.attention) continue;
    if (l.head_dim <= 0 || l.kv_heads <= 0) {
      throw ConfigError("ModelSpec.layers[" + std::to_string(i) + "]: attention layer needs kv_heads >= 1 and head_dim >= 1 (got " +
                        std::to_string(l.kv_heads) + ", " + std::to_string(l.head_dim) + ")");
    }
    attention_layers.push_back(static_cast<int>(i));
  }

  CacheSet set;
  // Per-layer schedules floor every layer at protected + 1 rows, where protected = n_sink plus the
  // recent window: validate() holds the average budget to that rule, and a layer the taper or the
  // schedule pushed below it could not evict (it threw mid-generation before).
  // An explicit window counts; "auto" (-1) fits itself to every budget (recent_fits_budget).
  const int window = std::max(config.evict_recent_window, 0);
  std::vector<int> pyramid;
  if (config.method == "pyramidkv") {
    pyramid = pyramid_budgets(static_cast<int>(attention_layers.size()), config.pyramidkv_budget,
                              config.pyramidkv_n_sink + window, config.pyramidkv_beta);
  }
  // An explicit squeeze_resolved_budget fixes every layer: no schedule to wait for.
  // Cross-layer importance for the H2O-core methods scored by attention (a lone layer has no one
  // to share with).
  const bool h2o_core = method_info(config.method).h2o_core;
  if (h2o_core && attention_layers.size() > 1) {
    const EvictionPolicy policy = make_eviction_policy(config, 0);
    if (scores_by_attention(policy.scoring) && policy.cross_layer > 0.0f) set.importance_ = std::make_shared<CrossLayerImportance>(attention_layers.size());
  }
  if (config.method == "squeeze" && !config.squeeze_resolved_budget && !attention_layers.empty()) {
    set.coordinator_ = std::make_shared<SqueezeCoordinator>(static_cast<int>(attention_layers.size()), config.squeeze_budget,
                                                            config.squeeze_n_sink + window, config.squeeze_strength);
  }
  set.caches_.resize(model.layers.size());
  for (std::size_t a = 0; a < attention_layers.size(); ++a) {
    const int i = attention_layers[a];
    KVCacheConfig layer_config = config;
    layer_config.head_dim = model.layers[static_cast<std::size_t>(i)].head_dim;
    // Wraps instead of overflowing at seed = INT_MAX: a seed is bits, not a count.
    layer_config.seed = static_cast<int>(static_cast<unsigned>(config.seed) + static_cast<unsigned>(i));
    LayerContext ctx;
    ctx.layer_id = i;  // the raw model layer index, as the original
    ctx.coordinator = set.coordinator_;
    if (!pyramid.empty()) ctx.budget = pyramid[a];
    set.caches_[static_cast<std::size_t>(i)] = make_method_cache(layer_config, ctx);
    if (set.importance_) {
      auto* sharing = dynamic_cast<SharesImportance*>(set.caches_[static_cast<std::size_t>(i)].get());
      if (sharing == nullptr) throw std::logic_error("KVCacheBuilder: an H2O-core method built a cache without the eviction core");
      sharing->share_importance(set.importance_, a);
    }
  }
  // Squeeze layers read the schedule from the coordinator at their own next call (a layer changes
  // only inside calls on it: see the threading rule in kvslim/cache.h).
  return set;
}

CacheSet::~CacheSet() = default;

CacheSet CacheSet::of_layers(std::vector<std::unique_ptr<KVCache>> layers) {
  CacheSet set;
  set.caches_ = std::move(layers);
  return set;
}

KVCache& CacheSet::at(std::size_t layer) const {
  if (layer >= caches_.size() || !caches_[layer]) {
    throw std::out_of_range("CacheSet has no cache for layer " + std::to_string(layer));
  }
  return *caches_[layer];
}

void CacheSet::set_rank_gather(std::shared_ptr<RankGather> gather) {
  if (coordinator_) coordinator_->set_rank_gather(gather);
  if (importance_) importance_->set_rank_gather(gather);
}

void CacheSet::reset() {
  if (coordinator_) coordinator_->reset();
  if (importance_) importance_->reset();
  for (auto& c : caches_) {
    if (c) c->reset();
  }
}

void CacheSet::reserve(std::size_t tokens) {
  for (const auto& c : caches_) {
    if (c) c->reserve(tokens);
  }
}

std::size_t CacheSet::resident_bytes() const {
  std::size_t total = 0;
  for (const auto& c : caches_) {
    if (c) total += c->stats().resident_bytes;
  }
  return total + (importance_ ? importance_->bytes() : 0);
}

std::size_t CacheSet::seen_fp16_bytes() const {
  std::size_t total = 0;
  for (const auto& c : caches_) {
    if (c) total += c->stats().seen_fp16_bytes;
  }
  return total;
}

}  // namespace kvslim
