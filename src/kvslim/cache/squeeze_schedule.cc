#include "cache/squeeze_schedule.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cache/eviction_core.h"
#include "cache/observation_check.h"
#include "kernels.h"
#include "kvslim/errors.h"

namespace kvslim {

SqueezeSchedule::SqueezeSchedule(const KVCacheConfig& config, std::shared_ptr<SqueezeCoordinator> coordinator, int layer_id)
    : coordinator_(std::move(coordinator)),
      layer_id_(layer_id),
      eager_(config.squeeze_prefill == "eager"),
      hidden_signal_(config.squeeze_signal == "hidden_cosine"),
      entropy_signal_(config.squeeze_signal == "attention_entropy"),
      coverage_signal_(config.squeeze_signal == "attention_coverage"),
      global_signal_(config.squeeze_signal == "global_topk"),
      first_head_only_(config.squeeze_concentration_heads == "first") {
  if (!coordinator_) adopted_ = true;  // a lone layer: fixed budget forever
}

std::size_t SqueezeSchedule::eviction_limit(std::size_t budget) const {
  if (adopted_ || eager_) return budget;
  // Deferred: never evict below the largest budget the schedule could still give this layer.
  return std::max<std::size_t>(budget, static_cast<std::size_t>(coordinator_->max_possible_budget()));
}

void SqueezeSchedule::add_needs(ObservationNeeds& n, std::size_t obs_window) const {
  n.hidden_states = coordinator_ && hidden_signal_ && !reported_;
  const bool signal = coordinator_ && (entropy_signal_ || coverage_signal_) && !reported_;
  // The attention layer signals read the window's last queries only (measure_attention_signal).
  if (signal && !n.attention) n.attention_queries = std::max<std::size_t>(obs_window, 1);
  n.attention = n.attention || signal;
}

std::optional<std::size_t> SqueezeSchedule::before_absorb(const std::function<HeadTerms()>& key_dispersion) {
  if (adopted_) return std::nullopt;
  if (eager_) {
    // Documented order: report on the first call, then adopt as soon as the schedule exists --
    // the last layer to report adopts before its own eviction, every other layer at its next call.
    if (!reported_ && key_signal()) report(key_dispersion());
    return poll();
  }
  // Deferred: a schedule finalised by another layer since this layer's last call is adopted (and
  // the layer trimmed to it) now, before the new tokens.
  if (auto budget = poll()) return budget;
  if (!reported_ && key_signal() && !has_pending_) {
    pending_terms_ = key_dispersion();
    has_pending_ = true;
  }
  return std::nullopt;
}

std::optional<std::size_t> SqueezeSchedule::after_step(const EvictionCore& core) {
  if (global_signal_ && coordinator_ && !reported_) {
    // Global top-k: this layer's evictable rows' scores (what eviction to the average would
    // choose among) go to the coordinator, which sets every budget from one threshold.
    reported_ = true;
    std::size_t protected_rows = 0;
    auto scores = core.evictable_scores(static_cast<std::size_t>(coordinator_->avg_budget()), protected_rows);
    coordinator_->report_scores(layer_id_, std::move(scores), core.heads_total(), protected_rows);
    return eager_ ? std::nullopt : poll();  // this report may have finalised: the last layer trims now
  }
  if (has_pending_ && !reported_) {
    has_pending_ = false;
    report(std::move(pending_terms_));
    if (!eager_) return poll();  // this report may have finalised: the last layer trims now
  }
  return std::nullopt;
}

HeadTerms SqueezeSchedule::measure_attention_signal(const AttentionObservation& obs, const EvictionCore& core) const {
  // Layer signals from the attention of the observation's last queries (the prompt's end, the
  // same window that scores the tokens), as a concentration in [0, 1] (high = needs little):
  // - attention_entropy: 1 - the mean normalised entropy H(p) / ln(visible) of each query's
  //   attention p (the KV group's weights over the rows it could see, renormalised);
  // - attention_coverage: the share of the window's attention mass that the top avg_budget rows
  //   hold, per head -- what eviction to the average budget would keep of it.
  const std::size_t Q = obs.queries, window = std::max<std::size_t>(core.policy().obs_window, 1);
  const std::size_t first = Q > window ? Q - window : 0;
  const std::size_t heads = obs.batch * obs.heads;
  // One term per head (its sum and count over the window's queries): the coordinator combines
  // every rank's heads in order (HeadTerms).
  HeadTerms terms;
  terms.batch = obs.batch;
  terms.sums.assign(heads, 0.0);
  terms.counts.assign(heads, 0.0);
  std::vector<double> mass;  // [tokens] one head's window attention (coverage)
  for (std::size_t head = 0; head < heads; ++head) {
    double& sum = terms.sums[head];
    double& count = terms.counts[head];
    const std::int64_t* pos = core.positions(head);
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
      count += 1.0;
    }
    if (coverage_signal_) {
      const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
      if (total <= 0.0) continue;
      const std::size_t k = std::min<std::size_t>(mass.size(), static_cast<std::size_t>(coordinator_->avg_budget()));
      std::nth_element(mass.begin(), mass.begin() + static_cast<std::ptrdiff_t>(k), mass.end(), std::greater<>());
      sum += std::accumulate(mass.begin(), mass.begin() + static_cast<std::ptrdiff_t>(k), 0.0) / total;
      count += 1.0;
    }
  }
  return terms;
}

void SqueezeSchedule::observe_attention(const AttentionObservation& obs, const EvictionCore& core, std::string_view who) {
  if (!coordinator_ || !(entropy_signal_ || coverage_signal_) || reported_ || has_pending_) return;
  if (obs.probs == nullptr || obs.tokens != core.rows() || obs.batch * obs.heads != core.heads_total() ||
      obs.stride < obs.tokens) {
    throw InputError(std::string(who) + ": attention observation does not match the last view");
  }
  check_observation_finite(obs, std::string(who));
  pending_terms_ = measure_attention_signal(obs, core);
  has_pending_ = true;
}

std::optional<std::size_t> SqueezeSchedule::observe_hidden(const HiddenObservation& obs) {
  if (!coordinator_ || !hidden_signal_ || reported_) return std::nullopt;
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
  // Under tensor parallelism every rank holds the same hidden states: rank 0's figure is agreed.
  report(HeadTerms::single(sum / static_cast<double>(n)));
  return eager_ ? std::nullopt : poll();
}

void SqueezeSchedule::report(HeadTerms terms) {
  concentration_ = terms.value();  // this rank's own figure; poll() takes the agreed one
  reported_ = true;
  coordinator_->report_concentration(layer_id_, std::move(terms));
}

std::optional<std::size_t> SqueezeSchedule::poll() {
  if (adopted_ || !coordinator_) return std::nullopt;
  const auto budget = coordinator_->resolved_budget(layer_id_);
  if (!budget) return std::nullopt;
  concentration_ = coordinator_->concentration(layer_id_).value_or(concentration_);  // the set's agreed figure
  adopted_ = true;
  return static_cast<std::size_t>(*budget);
}

std::size_t SqueezeSchedule::reset(std::size_t configured_budget) {
  concentration_ = 0.0;
  if (!coordinator_) return configured_budget;
  has_pending_ = false;
  // The schedule belongs to the set: a layer reset on its own keeps it (it was never re-scheduled
  // before, since the coordinator ignores reports once final); CacheSet::reset() clears both.
  if (const auto budget = coordinator_->resolved_budget(layer_id_)) {
    reported_ = adopted_ = true;
    concentration_ = coordinator_->concentration(layer_id_).value_or(0.0);
    return static_cast<std::size_t>(*budget);
  }
  reported_ = adopted_ = false;
  return static_cast<std::size_t>(coordinator_->avg_budget());
}

void SqueezeSchedule::add_figures(CacheStats& st, std::size_t eviction_limit) const {
  st.figures.emplace_back("concentration", concentration_);
  st.figures.emplace_back("rebudgeted", adopted_ ? 1.0 : 0.0);
  st.figures.emplace_back("eviction_limit", static_cast<double>(eviction_limit));
}

}  // namespace kvslim
