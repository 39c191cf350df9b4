// SqueezeAttention-adapted: the concentration proxy, the budget schedule and the coordinator.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "kvslim/rank_gather.h"

namespace kvslim {

// A layer signal as terms over the layer's KV heads, batch-major ([batch][heads]): the signal is
// sum(sums) / sum(counts) over every head (0 when no head counts). The coordinator combines them
// because under tensor parallelism no rank holds every head: it gathers every rank's terms and
// sums them in the single-process head order, so each rank gets the 1-process value to the bit.
struct HeadTerms {
  std::vector<double> sums, counts;  // [batch * local heads]
  std::size_t batch = 1;
  // The signal is the first term of rank 0 (squeeze_concentration_heads = first: global head 0;
  // a signal every rank measures alike, as the hidden states): the others' terms are not used.
  bool first_only = false;

  // One value (first_only): what a lone layer or a replicated signal reports.
  static HeadTerms single(double value) { return HeadTerms{{value}, {1.0}, 1, true}; }
  // One term of count 1 per head; first_only keeps values[0] alone.
  static HeadTerms per_head(const std::vector<double>& values, std::size_t batch, bool first_only);
  // sum(sums) / sum(counts) in order (first_only: the first term).
  double value() const;
};

// Mean off-diagonal cosine similarity of the n rows (each of length d) of `rows`:
// 1 for identical directions, 0 for orthogonal rows, scale-invariant; 0 when n < 2.
// O(n d): sum(G) = |sum u_i|^2 and trace(G) = sum |u_i|^2 with u_i = k_i / (|k_i| + 1e-8).
double concentration_score(const float* rows, std::size_t n, std::size_t d);

// Per-layer budgets: weight_i = (1 - clamp(c_i, 0, 1)) normalised to mean 1 (uniform if all are 1),
// budget_i = max(round_half_even(avg * ((1 - s) + s * weight_i)), n_sink + 1).
// Empty input gives {} (before the strength check, as the original); one layer gives
// {max(avg, n_sink + 1)}; strength outside [0, 1] throws ConfigError, a NaN concentration
// std::invalid_argument. A budget above INT_MAX saturates at INT_MAX (no sequence reaches it).
std::vector<int> squeeze_budgets(std::span<const double> concentrations, int avg_budget, int n_sink,
                                 double strength = 1.0);

// PyramidKV's fixed linear taper (kvpress's schedule) for comparison: layer 0 gets the most
// (up to 2 x avg_budget, saturating at INT_MAX like squeeze_budgets).
std::vector<int> pyramid_budgets(int n_layers, int avg_budget, int n_sink, double beta);

// KVzip-style global top-k: the rows whose scores are among the top sum_l heads_l * (avg -
// protected_l) of ALL layers stay, so a layer's budget is its protected rows plus its share of
// the global top (per head); then blended toward avg by strength, floor n_sink + 1. scores[l]
// holds layer l's evictable rows' scores (every head), heads[l] its heads, protected_rows[l] the
// rows per head it keeps anyway (sinks, recent window).
std::vector<int> global_topk_budgets(const std::vector<std::vector<float>>& scores, const std::vector<std::size_t>& heads,
                                     const std::vector<std::size_t>& protected_rows, int avg_budget, int n_sink,
                                     double strength);

// Collects one concentration per attention layer during prefill; when every layer has reported it
// computes the schedule once. Layers read their budget from it (resolved_budget) at their next
// call. Thread-safe: layers of one set may report and read from different threads.
class SqueezeCoordinator {
 public:
  SqueezeCoordinator(int n_layers, int avg_budget, int n_sink, double strength);

  // First report per layer wins; reports after finalisation are ignored. The report that completes
  // the set computes the schedule, through the rank gather when one is set (one collective).
  void report_concentration(int layer_id, HeadTerms terms);
  void report_concentration(int layer_id, double concentration) { report_concentration(layer_id, HeadTerms::single(concentration)); }
  // The global top-k rule instead of the concentration split: a layer reports its evictable
  // rows' scores (see global_topk_budgets); when every layer has reported, the schedule is the
  // global top-k one. Its concentration figure is 1 - its budget share (for reports).
  void report_scores(int layer_id, std::vector<float> scores, std::size_t heads, std::size_t protected_rows);
  bool is_finalized() const;
  std::optional<int> resolved_budget(int layer_id) const;
  std::optional<double> concentration(int layer_id) const;
  void reset();

  int n_layers() const { return n_layers_; }
  int avg_budget() const { return avg_budget_; }
  int n_sink() const { return n_sink_; }
  double strength() const { return strength_; }
  // The largest budget the schedule can give any layer (its weight is at most n_layers).
  int max_possible_budget() const;

  // Called with (layer_id, budget) for every layer at finalisation, in layer order, on the thread of
  // the report that completed the schedule (outside the coordinator's lock).
  using Listener = std::function<void(int layer_id, int budget)>;
  void set_listener(Listener listener) { listener_ = std::move(listener); }
  // Tensor parallelism: this set holds a slice of every layer's heads; the schedule is computed
  // from every rank's reports (RankGather). Set before the first report; null = this process alone.
  void set_rank_gather(std::shared_ptr<RankGather> gather);

 private:
  int n_layers_, avg_budget_, n_sink_;
  double strength_;
  mutable std::mutex mutex_;  // guards the maps and finalized_
  std::map<int, double> concentrations_;
  std::map<int, HeadTerms> terms_;
  std::shared_ptr<RankGather> gather_;
  struct LayerScores {
    std::vector<float> scores;
    std::size_t heads = 0, protected_rows = 0;
  };
  std::map<int, LayerScores> scores_;
  std::map<int, int> resolved_;
  bool finalized_ = false;
  Listener listener_;
  // Sets the schedule (caller holds mutex_); notify() calls the listener outside the lock.
  void publish_locked(const std::vector<int>& ids, const std::vector<int>& budgets);
  void notify(const std::vector<int>& ids, const std::vector<int>& budgets) const;
  // Every layer's concentration from every rank's terms (caller holds mutex_).
  std::vector<double> agreed_concentrations_locked();
  // Every rank's scores merged per layer (heads summed), for the global top-k (caller holds mutex_).
  void gather_scores_locked();
};

}  // namespace kvslim
