// attach_prior_scores (kvslim/prior_scores.h). The score itself is applied by the eviction core
// (EvictionCore::observation_contribution, the "prior" hook): this file only validates and routes
// it, so that when the eviction policy moves behind a registry (issue 23) the prior re-attaches
// to whatever object owns the prefill observation.
#include "kvslim/prior_scores.h"

#include <cmath>
#include <string>

#include "eviction_cache.h"
#include "kvslim/errors.h"

namespace kvslim {

bool attach_prior_scores(KVCache& cache, std::shared_ptr<const PriorScores> prior) {
  if (prior == nullptr) throw InputError("attach_prior_scores: no scores");
  if (prior->values.size() != prior->heads * prior->length) {
    throw InputError("attach_prior_scores: " + std::to_string(prior->values.size()) + " values for " +
                     std::to_string(prior->heads) + " heads x " + std::to_string(prior->length) + " positions");
  }
  for (float v : prior->values) {
    if (!std::isfinite(v) || v < 0.0f) throw InputError("attach_prior_scores: a score is negative, NaN or infinite");
  }
  if (!std::isfinite(prior->weight) || prior->weight < 0.0f) {
    throw InputError("attach_prior_scores: weight must be finite and >= 0");
  }
  auto* eviction = dynamic_cast<EvictionCache*>(&cache);
  if (eviction == nullptr || !scores_by_attention(eviction->core().policy().scoring)) return false;
  eviction->attach_prior(std::move(prior));
  return true;
}

}  // namespace kvslim
