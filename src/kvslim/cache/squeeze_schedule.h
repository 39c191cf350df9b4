// One layer's part in squeeze's shared schedule (SqueezeAttention-adapted): what the layer reports
// to the coordinator (its concentration signal, or its scores for the global top-k), when, and when
// it adopts the budget the coordinator resolves. The host cache (SqueezeCache) and the device
// eviction cache (cuda/device_eviction_cache.h) both hold one, so the protocol lives here once;
// the owner measures the keys (its rows are where it keeps them) and applies an adopted budget
// (budget = b, then its core trims to it).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "kvslim/cache.h"
#include "kvslim/config.h"
#include "kvslim/squeeze.h"

namespace kvslim {

class EvictionCore;

class SqueezeSchedule {
 public:
  // Without a coordinator the layer keeps its configured budget forever (a lone cache).
  SqueezeSchedule(const KVCacheConfig& config, std::shared_ptr<SqueezeCoordinator> coordinator, int layer_id);

  // The limit the owner evicts to while its own budget is `budget`: deferred prefill (default)
  // never evicts below the largest budget the schedule could still give the layer.
  std::size_t eviction_limit(std::size_t budget) const;
  // Adds what the layer signal needs to the eviction core's needs.
  void add_needs(ObservationNeeds& needs, std::size_t obs_window) const;
  // A call's rows arrive, before the owner absorbs them. key_dispersion() measures the call's keys
  // (mean off-diagonal cosine, squeeze/concentration.h) per head (HeadTerms::per_head with
  // first_head_only()); it is called at most once, on the layer's first call with the key signal.
  // Returns a budget to adopt now (before absorbing).
  std::optional<std::size_t> before_absorb(const std::function<HeadTerms()>& key_dispersion);
  // The step's eviction is done (after an absorb that evicts, or after an observation): reports
  // what is pending. Returns a budget to adopt now.
  std::optional<std::size_t> after_step(const EvictionCore& core);
  // An attention observation with host probabilities [B, H, Q, tokens], before the owner's core
  // observes it (the rows' positions are the core's): measures the attention signals.
  void observe_attention(const AttentionObservation& obs, const EvictionCore& core, std::string_view who);
  // A measurement is waiting for after_step (an owner whose observation did not step).
  bool report_pending() const { return has_pending_ && !reported_; }
  // The paper's hidden-state signal. Returns a budget to adopt now.
  std::optional<std::size_t> observe_hidden(const HiddenObservation& obs);
  // The owner was reset: the budget it starts from (the set's schedule, if one was resolved).
  std::size_t reset(std::size_t configured_budget);
  void add_figures(CacheStats& st, std::size_t eviction_limit) const;

  bool adopted() const { return adopted_; }
  double concentration() const { return concentration_; }
  bool first_head_only() const { return first_head_only_; }
  // The layer signal is the key dispersion (the documented proxy), measured by the owner.
  bool key_signal() const { return !hidden_signal_ && !entropy_signal_ && !coverage_signal_ && !global_signal_; }
  bool hidden_signal() const { return hidden_signal_; }
  // The next observation feeds the layer signal from the host's probabilities (entropy, coverage)
  // or the core's scores (global top-k), not yet reported: an owner that scores a prompt on the
  // device leaves that prompt to the host.
  bool signal_reads_observation() const {
    return coordinator_ && !reported_ && (entropy_signal_ || coverage_signal_ || global_signal_);
  }
  bool eager() const { return eager_; }

 private:
  HeadTerms measure_attention_signal(const AttentionObservation& obs, const EvictionCore& core) const;
  void report(HeadTerms terms);
  // The budget the coordinator finalised, once (adopted from then on).
  std::optional<std::size_t> poll();

  std::shared_ptr<SqueezeCoordinator> coordinator_;
  int layer_id_;
  bool eager_;          // documented order: evict to the average until finalised, adopt next call
  bool hidden_signal_;  // layer signal from hidden states instead of key dispersion
  bool entropy_signal_;   // layer signal from the entropy of the observed attention
  bool coverage_signal_;  // layer signal: attention mass the top avg_budget rows hold
  bool global_signal_;    // no layer signal: budgets from a global top-k of every layer's scores
  bool first_head_only_;
  bool reported_ = false, adopted_ = false;
  double concentration_ = 0.0;
  HeadTerms pending_terms_;  // measured before absorbing, reported after (deferred)
  bool has_pending_ = false;
};

}  // namespace kvslim
