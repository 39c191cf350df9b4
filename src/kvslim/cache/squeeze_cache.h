// SqueezeAttention-adapted: an H2O cache whose budget comes from the shared coordinator. It adds
// the concentration report and the one-shot re-budget to EvictionCache, nothing else.
#pragma once
#include <memory>

#include "eviction_cache.h"
#include "kvslim/config.h"
#include "kvslim/squeeze.h"

namespace kvslim {

class SqueezeCache : public EvictionCache {
 public:
  // Without a coordinator (KVCacheFactory::create) this is a fixed-budget H2O layer.
  SqueezeCache(const KVCacheConfig& config, std::shared_ptr<SqueezeCoordinator> coordinator, int layer_id);

  ObservationNeeds needs() const override;
  void observe_hidden(const HiddenObservation& obs) override;
  void observe_attention(const AttentionObservation& obs) override;
  void reset() override;

  bool rebudgeted() const { return adopted_; }
  double concentration() const { return concentration_; }

 protected:
  std::size_t eviction_limit() const override;
  void before_absorb(const BlockIntake& block) override;
  void after_step() override;
  void add_figures(CacheStats& st) const override;

 private:
  double measure_key_dispersion(const BlockIntake& block) const;
  double measure_attention_signal(const AttentionObservation& obs) const;
  void report(double concentration);
  // Adopts the budget the coordinator finalised, once it has (at this layer's own calls only).
  void poll_schedule();
  void adopt(int budget);

  std::shared_ptr<SqueezeCoordinator> coordinator_;
  bool eager_;          // documented order: evict to the average until finalised, adopt next call
  bool hidden_signal_;  // layer signal from hidden states instead of key dispersion
  bool entropy_signal_;   // layer signal from the entropy of the observed attention
  bool coverage_signal_;  // layer signal: attention mass the top avg_budget rows hold
  bool global_signal_;    // no layer signal: budgets from a global top-k of every layer's scores
  bool first_head_only_;
  bool reported_ = false, adopted_ = false;
  double concentration_ = 0.0;
  double pending_concentration_ = 0.0;  // measured before absorbing, reported after (deferred)
  bool has_pending_ = false;
};

}  // namespace kvslim
