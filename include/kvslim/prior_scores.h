// Prior scores: an importance for every (KV head, position) of a prompt, computed outside the
// cache before it compresses (issue 27: the question may come after the context, so the prompt's
// own last queries -- the observation window -- say nothing about what the next question needs).
// kvslim's engine computes them by reconstruction (engine/reconstruction_score.h, KVzip's idea:
// the model re-reads the context and each token is scored by the attention it gets while being
// copied); an integrator may bring any query-agnostic score.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvslim {

class KVCache;

struct PriorScores {
  std::size_t heads = 0;   // KV heads of the layer (batch 1)
  std::size_t length = 0;  // positions 0 .. length - 1
  std::vector<float> values;  // [heads, length]: importance of position p for head h, >= 0, finite
  // How much the prior counts against the observation window's own attention (both as attention
  // per observing query): rank = window mean + weight x prior. Large: the prior decides.
  float weight = 1.0f;

  float at(std::size_t head, std::int64_t position) const {
    return position >= 0 && static_cast<std::size_t>(position) < length ? values[head * length + static_cast<std::size_t>(position)] : 0.0f;
  }
};

// Gives an attention-scored H2O-core cache (h2o, squeeze, pyramidkv at their query-aware
// defaults) the prior for its next prefill: the first multi-query observation after this call
// ranks rows by it as above, then releases it (a later call, a reset sequence, sees none unless
// attached again; reset() keeps an attached prior, so it may be attached before a reset that
// starts the sequence). Returns false, attaching nothing, for any other cache. Throws
// kvslim::InputError when values.size() != heads * length or a value is negative or not finite.
bool attach_prior_scores(KVCache& cache, std::shared_ptr<const PriorScores> prior);

}  // namespace kvslim
