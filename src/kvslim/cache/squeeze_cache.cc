#include "squeeze_cache.h"

#include <cmath>
#include <vector>

#include "kernels.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"

namespace kvslim {
namespace {

EvictionPolicy squeeze_policy(const KVCacheConfig& c) {
  EvictionPolicy p;
  p.n_sink = static_cast<std::size_t>(c.squeeze_n_sink);
  p.recent_window = static_cast<std::size_t>(c.evict_recent_window);
  p.scoring = parse_scoring(c.evict_scoring);
  return p;
}

}  // namespace

SqueezeCache::SqueezeCache(const KVCacheConfig& config, std::shared_ptr<SqueezeCoordinator> coordinator, int layer_id)
    : EvictionCache("squeeze", squeeze_policy(config),
                    static_cast<std::size_t>(config.squeeze_resolved_budget.value_or(config.squeeze_budget))),
      coordinator_(std::move(coordinator)),
      eager_(config.squeeze_prefill == "eager"),
      hidden_signal_(config.squeeze_signal == "hidden_cosine"),
      first_head_only_(config.squeeze_concentration_heads == "first") {
  set_layer_id(layer_id);
  if (!coordinator_) adopted_ = true;  // a lone layer: fixed budget forever
}

ObservationNeeds SqueezeCache::needs() const {
  ObservationNeeds n = EvictionCache::needs();
  n.hidden_states = coordinator_ && hidden_signal_ && !reported_;
  return n;
}

std::size_t SqueezeCache::eviction_limit() const {
  if (adopted_ || eager_) return budget_;
  // Deferred: never evict below the largest budget the schedule could still give this layer.
  return std::max<std::size_t>(budget_, static_cast<std::size_t>(coordinator_->max_possible_budget()));
}

double SqueezeCache::measure_key_dispersion(const BlockIntake& block) const {
  const std::size_t heads = first_head_only_ ? 1 : block.batch() * block.heads();
  const std::size_t S = block.tokens(), D = block.head_dim();
  std::vector<float> rows(S * D);  // [S, D] one head's incoming keys as fp32 (prefill only)
  double sum = 0.0;
  for (std::size_t head = 0; head < heads; ++head) {
    convert_fp16_to_f32(block.key_row(head, 0), rows.data(), S * D);
    sum += concentration_score(rows.data(), S, D);
  }
  return sum / static_cast<double>(heads);
}

void SqueezeCache::before_absorb(const BlockIntake& block) {
  if (adopted_) return;
  if (eager_) {
    // Documented order: report on the first call, then adopt as soon as the schedule exists --
    // the last layer to report adopts before its own eviction, every other layer at its next call.
    if (!reported_ && !hidden_signal_) report(measure_key_dispersion(block));
    poll_schedule();
    return;
  }
  // Deferred: a schedule finalised by another layer since this layer's last call is adopted (and
  // the layer trimmed to it) now, before the new tokens.
  poll_schedule();
  if (adopted_) return;
  if (!reported_ && !hidden_signal_ && !has_pending_) {
    pending_concentration_ = measure_key_dispersion(block);
    has_pending_ = true;
  }
}

void SqueezeCache::after_step() {
  if (has_pending_ && !reported_) {
    has_pending_ = false;
    report(pending_concentration_);
    if (!eager_) poll_schedule();  // this report may have finalised: the last layer trims now
  }
}

void SqueezeCache::observe_hidden(const HiddenObservation& obs) {
  if (!coordinator_ || !hidden_signal_ || reported_) return;
  if (obs.before == nullptr || obs.after == nullptr || obs.tokens == 0 || obs.hidden == 0) {
    throw InputError("squeeze cache: hidden-state observation is empty");
  }
  // The paper's layer signal: mean over prompt tokens of cos(h_before, h_after). A layer that
  // changes its input little (high cosine) needs little budget, like a concentrated one.
  double sum = 0.0;
  const std::size_t n = obs.batch * obs.tokens;
  for (std::size_t t = 0; t < n; ++t) {
    const float* a = obs.before + t * obs.hidden;
    const float* b = obs.after + t * obs.hidden;
    const double ab = kernels::dot_f32(a, b, obs.hidden);
    const double aa = kernels::dot_f32(a, a, obs.hidden), bb = kernels::dot_f32(b, b, obs.hidden);
    sum += ab / (std::sqrt(aa) * std::sqrt(bb) + 1e-8);
  }
  report(sum / static_cast<double>(n));
  if (!eager_) poll_schedule();
}

void SqueezeCache::report(double concentration) {
  concentration_ = concentration;
  reported_ = true;
  coordinator_->report_concentration(layer_id(), concentration);
}

void SqueezeCache::poll_schedule() {
  if (adopted_ || !coordinator_) return;
  if (const auto budget = coordinator_->resolved_budget(layer_id())) adopt(*budget);
}

void SqueezeCache::adopt(int budget) {
  adopted_ = true;
  rebudget(static_cast<std::size_t>(budget));
}

void SqueezeCache::reset() {
  EvictionCache::reset();
  concentration_ = 0.0;
  if (!coordinator_) return;
  has_pending_ = false;
  // The schedule belongs to the set: a layer reset on its own keeps it (it was never re-scheduled
  // before, since the coordinator ignores reports once final); CacheSet::reset() clears both.
  if (const auto budget = coordinator_->resolved_budget(layer_id())) {
    reported_ = adopted_ = true;
    budget_ = static_cast<std::size_t>(*budget);
    concentration_ = coordinator_->concentration(layer_id()).value_or(0.0);
    return;
  }
  reported_ = adopted_ = false;
  budget_ = static_cast<std::size_t>(coordinator_->avg_budget());
}

void SqueezeCache::add_figures(CacheStats& st) const {
  st.figures.emplace_back("concentration", concentration_);
  st.figures.emplace_back("rebudgeted", adopted_ ? 1.0 : 0.0);
  st.figures.emplace_back("eviction_limit", static_cast<double>(eviction_limit()));
}

}  // namespace kvslim
