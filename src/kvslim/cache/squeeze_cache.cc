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
      coordinator_(std::move(coordinator)),
      eager_(config.squeeze_prefill == "eager"),
      hidden_signal_(config.squeeze_signal == "hidden_cosine"),
      entropy_signal_(config.squeeze_signal == "attention_entropy"),
      coverage_signal_(config.squeeze_signal == "attention_coverage"),
      global_signal_(config.squeeze_signal == "global_topk"),
      first_head_only_(config.squeeze_concentration_heads == "first") {
  set_layer_id(layer_id);
  if (!coordinator_) adopted_ = true;  // a lone layer: fixed budget forever
}

ObservationNeeds SqueezeCache::needs() const {
  ObservationNeeds n = EvictionCache::needs();
  n.hidden_states = coordinator_ && hidden_signal_ && !reported_;
  const bool signal = coordinator_ && (entropy_signal_ || coverage_signal_) && !reported_;
  // The attention layer signals read the window's last queries only (measure_attention_signal).
  if (signal && !n.attention) n.attention_queries = std::max<std::size_t>(core_.policy().obs_window, 1);
  n.attention = n.attention || signal;
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
    if (!reported_ && !hidden_signal_ && !entropy_signal_ && !coverage_signal_ && !global_signal_) report(measure_key_dispersion(block));
    poll_schedule();
    return;
  }
  // Deferred: a schedule finalised by another layer since this layer's last call is adopted (and
  // the layer trimmed to it) now, before the new tokens.
  poll_schedule();
  if (adopted_) return;
  if (!reported_ && !hidden_signal_ && !entropy_signal_ && !coverage_signal_ && !global_signal_ && !has_pending_) {
    pending_concentration_ = measure_key_dispersion(block);
    has_pending_ = true;
  }
}

void SqueezeCache::after_step() {
  if (global_signal_ && coordinator_ && !reported_) {
    // Global top-k: this layer's evictable rows' scores (what eviction to the average would
    // choose among) go to the coordinator, which sets every budget from one threshold.
    reported_ = true;
    std::size_t protected_rows = 0;
    auto scores = core_.evictable_scores(static_cast<std::size_t>(coordinator_->avg_budget()), protected_rows);
    coordinator_->report_scores(layer_id(), std::move(scores), core_.heads_total(), protected_rows);
    if (!eager_) poll_schedule();  // this report may have finalised: the last layer trims now
    return;
  }
  if (has_pending_ && !reported_) {
    has_pending_ = false;
    report(pending_concentration_);
    if (!eager_) poll_schedule();  // this report may have finalised: the last layer trims now
  }
}

double SqueezeCache::measure_attention_signal(const AttentionObservation& obs) const {
  // Layer signals from the attention of the observation's last queries (the prompt's end, the
  // same window that scores the tokens), as a concentration in [0, 1] (high = needs little):
  // - attention_entropy: 1 - the mean normalised entropy H(p) / ln(visible) of each query's
  //   attention p (the KV group's weights over the rows it could see, renormalised);
  // - attention_coverage: the share of the window's attention mass that the top avg_budget rows
  //   hold, per head -- what eviction to the average budget would keep of it.
  const std::size_t Q = obs.queries, window = std::max<std::size_t>(core_.policy().obs_window, 1);
  const std::size_t first = Q > window ? Q - window : 0;
  const std::size_t heads = obs.batch * obs.heads;
  double sum = 0.0;
  std::size_t count = 0;
  std::vector<double> mass;  // [tokens] one head's window attention (coverage)
  for (std::size_t head = 0; head < heads; ++head) {
    const std::int64_t* pos = core_.positions(head);
    if (coverage_signal_) mass.assign(obs.tokens, 0.0);
    for (std::size_t q = first; q < Q; ++q) {
      const float* p = obs.probs + (head * Q + q) * obs.stride;
      if (coverage_signal_) {
        for (std::size_t i = 0; i < obs.tokens; ++i) mass[i] += p[i];
        continue;
      }
      const std::int64_t qpos = obs.query_positions.empty() ? std::numeric_limits<std::int64_t>::max() : obs.query_positions[q];
      double total = 0.0;
      std::size_t visible = 0;
      for (std::size_t i = 0; i < obs.tokens; ++i) {
        total += p[i];
        visible += pos[i] <= qpos ? 1 : 0;
      }
      if (visible < 2 || total <= 0.0) continue;
      double h = 0.0;
      for (std::size_t i = 0; i < obs.tokens; ++i) {
        const double x = p[i] / total;
        if (x > 0.0) h -= x * std::log(x);
      }
      sum += 1.0 - h / std::log(static_cast<double>(visible));
      ++count;
    }
    if (coverage_signal_) {
      const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
      if (total <= 0.0) continue;
      const std::size_t k = std::min<std::size_t>(mass.size(), static_cast<std::size_t>(coordinator_->avg_budget()));
      std::nth_element(mass.begin(), mass.begin() + static_cast<std::ptrdiff_t>(k), mass.end(), std::greater<>());
      sum += std::accumulate(mass.begin(), mass.begin() + static_cast<std::ptrdiff_t>(k), 0.0) / total;
      ++count;
    }
  }
  return count == 0 ? 0.0 : sum / static_cast<double>(count);
}

void SqueezeCache::observe_attention(const AttentionObservation& obs) {
  if (coordinator_ && (entropy_signal_ || coverage_signal_) && !reported_ && !has_pending_) {
    if (obs.probs == nullptr || obs.tokens != core_.rows() || obs.batch * obs.heads != core_.heads_total() ||
        obs.stride < obs.tokens) {
      throw InputError("squeeze cache: attention observation does not match the last view");
    }
    check_observation_finite(obs, "squeeze cache");
    pending_concentration_ = measure_attention_signal(obs);
    has_pending_ = true;
  }
  EvictionCache::observe_attention(obs);
  if (has_pending_ && !reported_) after_step();  // key-proxy scoring: the base did not step
}

void SqueezeCache::observe_hidden(const HiddenObservation& obs) {
  if (!coordinator_ || !hidden_signal_ || reported_) return;
  if (obs.before == nullptr || obs.after == nullptr || obs.tokens == 0 || obs.hidden == 0) {
    throw InputError("squeeze cache: hidden-state observation is empty");
  }
  check_observation_finite(obs, "squeeze cache");
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
  if (const auto budget = coordinator_->resolved_budget(layer_id())) {
    if (global_signal_) concentration_ = coordinator_->concentration(layer_id()).value_or(0.0);
    adopt(*budget);
  }
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
