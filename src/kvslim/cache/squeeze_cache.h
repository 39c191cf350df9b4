// SqueezeAttention-adapted: an H2O cache whose budget comes from the shared coordinator. It adds
// the layer's part in the schedule (SqueezeSchedule: the concentration report and the one-shot
// re-budget) to EvictionCache, and measures the key signal on the rows it takes in.
#pragma once
#include <memory>

#include "cache/squeeze_schedule.h"
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

  bool rebudgeted() const { return schedule_.adopted(); }
  double concentration() const { return schedule_.concentration(); }

 protected:
  std::size_t eviction_limit() const override { return schedule_.eviction_limit(budget_); }
  void before_absorb(const BlockIntake& block) override;
  void after_step() override;
  void add_figures(CacheStats& st) const override { schedule_.add_figures(st, eviction_limit()); }

 private:
  HeadTerms measure_key_dispersion(const BlockIntake& block) const;
  void adopt(std::optional<std::size_t> budget) {
    if (budget) rebudget(*budget);
  }

  SqueezeSchedule schedule_;
};

}  // namespace kvslim
