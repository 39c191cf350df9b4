// SqueezeCoordinator: one shared object per model; collects per-layer concentrations during
// prefill and publishes the budget schedule exactly once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvslim/errors.h"
#include "kvslim/squeeze.h"

namespace kvslim {

HeadTerms HeadTerms::per_head(const std::vector<double>& values, std::size_t batch, bool first_only) {
  HeadTerms t;
  t.batch = batch;
  t.first_only = first_only;
  t.sums.assign(values.begin(), first_only && !values.empty() ? values.begin() + 1 : values.end());
  t.counts.assign(t.sums.size(), 1.0);
  return t;
}

double HeadTerms::value() const {
  if (first_only) return sums.empty() ? 0.0 : sums[0] / counts[0];
  double sum = 0.0, count = 0.0;
  for (std::size_t i = 0; i < sums.size(); ++i) {
    sum += sums[i];
    count += counts[i];
  }
  return count > 0.0 ? sum / count : 0.0;
}

namespace {

// Reads a rank's packed vector: a field at a time, refusing a short one.
struct Unpacker {
  const std::vector<double>& v;
  std::size_t rank, at = 0;
  double next(const char* what) {
    if (at >= v.size()) {
      throw InputError("squeeze coordinator: rank " + std::to_string(rank) + "'s gathered statistics end before its " + what +
                       " (the ranks run different models or configs?)");
    }
    return v[at++];
  }
};

void check_gathered(const std::vector<std::vector<double>>& all, const char* what) {
  if (all.empty()) throw InputError(std::string("squeeze coordinator: the rank gather returned no rank for the ") + what);
}

}  // namespace

void SqueezeCoordinator::set_rank_gather(std::shared_ptr<RankGather> gather) {
  std::lock_guard<std::mutex> lock(mutex_);
  gather_ = std::move(gather);
}

std::vector<double> SqueezeCoordinator::agreed_concentrations_locked() {
  std::vector<double> values;
  if (!gather_) {
    for (const auto& [id, t] : terms_) values.push_back(t.value());  // std::map: ascending layer id
    return values;
  }
  // One collective for every layer: [layer id, batch, first_only, n, sums..., counts...] per layer.
  std::vector<double> packed;
  for (const auto& [id, t] : terms_) {
    packed.insert(packed.end(), {static_cast<double>(id), static_cast<double>(t.batch), t.first_only ? 1.0 : 0.0,
                                 static_cast<double>(t.sums.size())});
    packed.insert(packed.end(), t.sums.begin(), t.sums.end());
    packed.insert(packed.end(), t.counts.begin(), t.counts.end());
  }
  const auto all = gather_->all_gather(packed);
  check_gathered(all, "concentrations");
  std::vector<Unpacker> ranks;
  for (std::size_t r = 0; r < all.size(); ++r) ranks.push_back(Unpacker{all[r], r});
  for (const auto& [id, mine] : terms_) {
    // Every rank's terms of this layer, then reassembled batch-major: batch row b is rank 0's heads
    // of row b, then rank 1's... (ranks hold consecutive head slices), the order one process sums.
    std::vector<HeadTerms> of_rank(all.size());
    for (std::size_t r = 0; r < all.size(); ++r) {
      Unpacker& u = ranks[r];
      const double rid = u.next("layer id"), batch = u.next("batch"), first = u.next("head rule"), n = u.next("term count");
      if (rid != id || batch != static_cast<double>(mine.batch) || (first != 0.0) != mine.first_only) {
        throw InputError("squeeze coordinator: rank " + std::to_string(r) + " reported layer " + std::to_string(static_cast<long long>(rid)) +
                         " (batch " + std::to_string(static_cast<long long>(batch)) + ") where this rank reported layer " +
                         std::to_string(id) + " (batch " + std::to_string(mine.batch) + "): the ranks must run the same model, config and batch");
      }
      HeadTerms& t = of_rank[r];
      t.batch = mine.batch;
      t.first_only = mine.first_only;
      for (double i = 0; i < n; ++i) t.sums.push_back(u.next("terms"));
      for (double i = 0; i < n; ++i) t.counts.push_back(u.next("counts"));
      if (!t.first_only && t.batch > 0 && t.sums.size() % t.batch != 0) {
        throw InputError("squeeze coordinator: rank " + std::to_string(r) + "'s layer " + std::to_string(id) + " has " +
                         std::to_string(t.sums.size()) + " head terms, not a multiple of its batch " + std::to_string(t.batch));
      }
    }
    HeadTerms merged;
    merged.batch = mine.batch;
    merged.first_only = mine.first_only;
    if (mine.first_only) {
      merged = of_rank[0];  // global head 0 (or the signal every rank measured alike) is rank 0's
    } else {
      for (std::size_t b = 0; b < mine.batch; ++b) {
        for (const HeadTerms& t : of_rank) {
          const std::size_t h = t.sums.size() / mine.batch;
          merged.sums.insert(merged.sums.end(), t.sums.begin() + static_cast<std::ptrdiff_t>(b * h),
                             t.sums.begin() + static_cast<std::ptrdiff_t>((b + 1) * h));
          merged.counts.insert(merged.counts.end(), t.counts.begin() + static_cast<std::ptrdiff_t>(b * h),
                               t.counts.begin() + static_cast<std::ptrdiff_t>((b + 1) * h));
        }
      }
    }
    values.push_back(merged.value());
  }
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (ranks[r].at != all[r].size()) {
      throw InputError("squeeze coordinator: rank " + std::to_string(r) + " reported more layers than this rank's " +
                       std::to_string(terms_.size()));
    }
  }
  return values;
}

void SqueezeCoordinator::gather_scores_locked() {
  if (!gather_) return;
  // One collective for every layer: [layer id, heads, protected rows, n, scores...] per layer.
  std::vector<double> packed;
  for (const auto& [id, ls] : scores_) {
    packed.insert(packed.end(), {static_cast<double>(id), static_cast<double>(ls.heads), static_cast<double>(ls.protected_rows),
                                 static_cast<double>(ls.scores.size())});
    packed.insert(packed.end(), ls.scores.begin(), ls.scores.end());  // float -> double -> float: exact
  }
  const auto all = gather_->all_gather(packed);
  check_gathered(all, "global top-k scores");
  std::vector<Unpacker> ranks;
  for (std::size_t r = 0; r < all.size(); ++r) ranks.push_back(Unpacker{all[r], r});
  for (auto& [id, mine] : scores_) {
    LayerScores merged;
    for (std::size_t r = 0; r < all.size(); ++r) {
      Unpacker& u = ranks[r];
      const double rid = u.next("layer id"), heads = u.next("heads"), prot = u.next("protected rows"), n = u.next("score count");
      if (rid != id || prot != static_cast<double>(mine.protected_rows)) {
        throw InputError("squeeze coordinator: rank " + std::to_string(r) + " reported layer " + std::to_string(static_cast<long long>(rid)) +
                         " with " + std::to_string(static_cast<long long>(prot)) + " protected rows where this rank reported layer " +
                         std::to_string(id) + " with " + std::to_string(mine.protected_rows) +
                         ": the ranks must run the same model, config and tokens");
      }
      merged.heads += static_cast<std::size_t>(heads);
      for (double i = 0; i < n; ++i) merged.scores.push_back(static_cast<float>(u.next("scores")));
    }
    merged.protected_rows = mine.protected_rows;
    mine = std::move(merged);  // the top-k's threshold and counts do not depend on the order
  }
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (ranks[r].at != all[r].size()) {
      throw InputError("squeeze coordinator: rank " + std::to_string(r) + " reported more layers than this rank's " +
                       std::to_string(scores_.size()));
    }
  }
}

SqueezeCoordinator::SqueezeCoordinator(int n_layers, int avg_budget, int n_sink, double strength)
    : n_layers_(n_layers), avg_budget_(avg_budget), n_sink_(n_sink), strength_(strength) {}

void SqueezeCoordinator::report_concentration(int layer_id, HeadTerms terms) {
  std::vector<int> ids, budgets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finalized_ || terms_.count(layer_id) != 0) return;  // first report wins
    concentrations_[layer_id] = terms.value();  // this rank's own figure until the set agrees
    terms_[layer_id] = std::move(terms);
    if (static_cast<int>(terms_.size()) < n_layers_) return;

    const std::vector<double> values = agreed_concentrations_locked();
    for (const auto& [id, t] : terms_) ids.push_back(id);  // std::map: ascending layer id
    for (std::size_t i = 0; i < ids.size(); ++i) concentrations_[ids[i]] = values[i];
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
    gather_scores_locked();
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
  terms_.clear();
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
