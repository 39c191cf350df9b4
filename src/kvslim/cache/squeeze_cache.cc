#include "squeeze_cache.h"
#include "cache/observation_check.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"

namespace kvslim {
SqueezeCache::SqueezeCache(const KVCacheConfig& config, std::shared_ptr<SqueezeCoordinator> coordinator, int layer_id)
    : EvictionCache("squeeze", make_eviction_policy(config, config.squeeze_n_sink),
                    static_cast<std::size_t>(config.squeeze_resolved_budget.value_or(config.squeeze_budget)),
                    make_row_storage(config)),
      schedule_(config, std::move(coordinator), layer_id) {
  set_layer_id(layer_id);
}

ObservationNeeds SqueezeCache::needs() const {
  ObservationNeeds n = EvictionCache::needs();
  schedule_.add_needs(n, core_.policy().obs_window);
  return n;
}

HeadTerms SqueezeCache::measure_key_dispersion(const BlockIntake& block) const {
  const std::size_t heads = schedule_.first_head_only() ? 1 : block.batch() * block.heads();
  const std::size_t S = block.tokens(), D = block.head_dim();
  std::vector<float> rows(S * D);  // [S, D] one head's incoming keys as fp32 (prefill only)
  std::vector<double> per_head(heads);
  for (std::size_t head = 0; head < heads; ++head) {
    convert_fp16_to_f32(block.key_row(head, 0), rows.data(), S * D);
    per_head[head] = concentration_score(rows.data(), S, D);
  }
  return HeadTerms::per_head(per_head, block.batch(), schedule_.first_head_only());
}

void SqueezeCache::before_absorb(const BlockIntake& block) {
  adopt(schedule_.before_absorb([&] { return measure_key_dispersion(block); }));
}

void SqueezeCache::after_step() { adopt(schedule_.after_step(core_)); }

void SqueezeCache::observe_attention(const AttentionObservation& obs) {
  schedule_.observe_attention(obs, core_, "squeeze cache");
  EvictionCache::observe_attention(obs);
  if (schedule_.report_pending()) after_step();  // key-proxy scoring: the base did not step
}

void SqueezeCache::observe_hidden(const HiddenObservation& obs) { adopt(schedule_.observe_hidden(obs)); }

void SqueezeCache::reset() {
  EvictionCache::reset();
  budget_ = schedule_.reset(budget_);
}

}  // namespace kvslim
