// SqueezeCoordinator: one shared object per model; collects per-layer concentrations during
// prefill and publishes the budget schedule exactly once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvslim/squeeze.h"

namespace kvslim {

SqueezeCoordinator::SqueezeCoordinator(int n_layers, int avg_budget, int n_sink, double strength)
    : n_layers_(n_layers), avg_budget_(avg_budget), n_sink_(n_sink), strength_(strength) {}

void SqueezeCoordinator::report_concentration(int layer_id, double concentration) {
  std::vector<int> ids, budgets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finalized_ || concentrations_.count(layer_id) != 0) return;  // first report wins
    concentrations_[layer_id] = concentration;
    if (static_cast<int>(concentrations_.size()) < n_layers_) return;

    std::vector<double> values;
    for (const auto& [id, c] : concentrations_) {  // std::map: ascending layer id
      ids.push_back(id);
      values.push_back(c);
    }
    budgets = squeeze_budgets(values, avg_budget_, n_sink_, strength_);
    publish_locked(ids, budgets);
  }
  notify(ids, budgets);
}

void SqueezeCoordinator::report_scores(int layer_id, std::vector<float> scores, std::size_t heads,
                                       std::size_t protected_rows) {
  std::vector<int> ids, budgets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finalized_ || scores_.count(layer_id) != 0) return;  // first report wins
    scores_[layer_id] = LayerScores{std::move(scores), heads, protected_rows};
    if (static_cast<int>(scores_.size()) < n_layers_) return;
    std::vector<std::vector<float>> all;
    std::vector<std::size_t> heads_of, protected_of;
    for (auto& [id, ls] : scores_) {
      ids.push_back(id);
      all.push_back(std::move(ls.scores));
      heads_of.push_back(ls.heads);
      protected_of.push_back(ls.protected_rows);
    }
    budgets = global_topk_budgets(all, heads_of, protected_of, avg_budget_, n_sink_, strength_);
    double total = 0;
    for (int b : budgets) total += b;
    for (std::size_t i = 0; i < ids.size(); ++i) concentrations_[ids[i]] = total > 0 ? 1.0 - budgets[i] / total : 0.0;
    publish_locked(ids, budgets);
  }
  notify(ids, budgets);
}

void SqueezeCoordinator::publish_locked(const std::vector<int>& ids, const std::vector<int>& budgets) {
  for (std::size_t i = 0; i < ids.size(); ++i) resolved_[ids[i]] = budgets[i];
  finalized_ = true;
}

void SqueezeCoordinator::notify(const std::vector<int>& ids, const std::vector<int>& budgets) const {
  if (listener_) {
    for (std::size_t i = 0; i < ids.size(); ++i) listener_(ids[i], budgets[i]);
  }
}

bool SqueezeCoordinator::is_finalized() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finalized_;
}

std::optional<int> SqueezeCoordinator::resolved_budget(int layer_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!finalized_) return std::nullopt;
  const auto it = resolved_.find(layer_id);
  if (it == resolved_.end()) return std::nullopt;
  return it->second;
}

std::optional<double> SqueezeCoordinator::concentration(int layer_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = concentrations_.find(layer_id);
  if (it == concentrations_.end()) return std::nullopt;
  return it->second;
}

void SqueezeCoordinator::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  concentrations_.clear();
  scores_.clear();
  resolved_.clear();
  finalized_ = false;
}

int SqueezeCoordinator::max_possible_budget() const {
  // A layer's weight is at most n_layers (every other layer at concentration 1).
  const double w = std::max(1, n_layers_);
  double b = std::ceil(avg_budget_ * ((1.0 - strength_) + strength_ * w));
  // In double and saturated: 6e8 x 4 layers does not fit an int (it wrapped to the floor).
  const double floor_budget = static_cast<double>(n_sink_) + 1.0;
  if (!(b >= floor_budget)) b = floor_budget;
  return static_cast<int>(std::min(b, static_cast<double>(std::numeric_limits<int>::max())));
}

}  // namespace kvslim
