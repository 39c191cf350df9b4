#include "cross_layer_importance.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvslim {

bool CrossLayerImportance::join(std::size_t layer, std::size_t call) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (layer >= layers_) return false;
  if (started_ && call < call_) return false;
  if (!started_ || call > call_) {
    // A new prefill call: the last one's importance was already added to the scores it concerned.
    clear_storage();
    std::fill(left_.begin(), left_.end(), 0);
    call_ = call;
    started_ = true;
  }
  return true;
}

void CrossLayerImportance::read(std::size_t layer, std::size_t batch_row, const std::int64_t* positions, std::size_t n,
                                float* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fill(out, out + n, 0.0f);
  if (batch_row >= entries_.size()) return;
  const std::vector<Entry>& e = entries_[batch_row];
  std::size_t j = 0;
  for (std::size_t i = 0; i < n; ++i) {
    while (j < e.size() && e[j].position < positions[i]) ++j;
    if (j == e.size()) break;
    if (e[j].position == positions[i]) out[i] = e[j].best_layer == layer ? e[j].second : e[j].best;
  }
}

void CrossLayerImportance::post(std::size_t layer, std::size_t batch_row, const std::int64_t* positions,
                                const float* values, std::size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (layer >= layers_) return;
  if (pending_.size() < layers_) pending_.resize(layers_);
  auto& rows = pending_[layer];
  if (rows.size() <= batch_row) rows.resize(batch_row + 1);
  for (std::size_t i = 0; i < n; ++i) rows[batch_row].emplace_back(positions[i], values[i]);
}

void CrossLayerImportance::merge_locked(std::uint32_t L, std::vector<std::vector<std::pair<std::int64_t, float>>>& rows) {
  // One layer's value into an entry: `second` stays the largest value of the layers but best_layer.
  auto add = [L](Entry& m, float v) {
    if (m.best_layer == L) {
      m.best = std::max(m.best, v);
    } else if (v > m.best) {
      m.second = m.best;  // the old best is the largest of every layer but the new best one
      m.best = v;
      m.best_layer = L;
    } else {
      m.second = std::max(m.second, v);
    }
  };
  if (entries_.size() < rows.size()) entries_.resize(rows.size());
  for (std::size_t b = 0; b < rows.size(); ++b) {
    auto& posts = rows[b];
    // Maxima do not depend on the order values arrive in: sorting by position only makes the merge linear.
    std::sort(posts.begin(), posts.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<Entry>& e = entries_[b];
    merged_.clear();
    merged_.reserve(e.size() + posts.size());
    std::size_t j = 0;
    for (const auto& [position, value] : posts) {
      while (j < e.size() && e[j].position < position) merged_.push_back(e[j++]);
      if (!merged_.empty() && merged_.back().position == position) {
        add(merged_.back(), value);  // a position posted again (another head, another rank)
      } else if (j < e.size() && e[j].position == position) {
        merged_.push_back(e[j++]);
        add(merged_.back(), value);
      } else {
        merged_.push_back(Entry{position, value, 0.0f, L});
      }
    }
    while (j < e.size()) merged_.push_back(e[j++]);
    e.swap(merged_);
  }
}

void CrossLayerImportance::leave(std::size_t layer, bool publish) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (layer >= layers_) return;
  std::vector<std::vector<std::pair<std::int64_t, float>>> rows;
  if (layer < pending_.size()) rows.swap(pending_[layer]);
  if (publish && gather_) {
    // Every rank's posts of this layer: [batch row, position, value] triplets (exact in double).
    std::vector<double> packed;
    for (std::size_t b = 0; b < rows.size(); ++b) {
      for (const auto& [position, value] : rows[b]) packed.insert(packed.end(), {static_cast<double>(b), static_cast<double>(position), value});
    }
    const std::shared_ptr<RankGather> gather = gather_;
    lock.unlock();  // the collective waits for the other ranks: this rank's other threads may read meanwhile
    const auto all = gather->all_gather(packed);
    lock.lock();
    rows.clear();
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].size() % 3 != 0) {
        throw std::invalid_argument("cross-layer importance: rank " + std::to_string(r) + " gathered " + std::to_string(all[r].size()) +
                                    " numbers for layer " + std::to_string(layer) + ", not (batch row, position, value) triplets");
      }
      for (std::size_t i = 0; i < all[r].size(); i += 3) {
        const auto b = static_cast<std::size_t>(all[r][i]);
        if (rows.size() <= b) rows.resize(b + 1);
        rows[b].emplace_back(static_cast<std::int64_t>(all[r][i + 1]), static_cast<float>(all[r][i + 2]));
      }
    }
  }
  if (publish) merge_locked(static_cast<std::uint32_t>(layer), rows);
  left_[layer] = 1;
  if (std::all_of(left_.begin(), left_.end(), [](char c) { return c != 0; })) clear_storage();
}

void CrossLayerImportance::set_rank_gather(std::shared_ptr<RankGather> gather) {
  std::lock_guard<std::mutex> lock(mutex_);
  gather_ = std::move(gather);
}

void CrossLayerImportance::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  clear_storage();
  std::fill(left_.begin(), left_.end(), 0);
  started_ = false;
  call_ = 0;
}

void CrossLayerImportance::clear_storage() {
  std::vector<std::vector<Entry>>().swap(entries_);
  std::vector<Entry>().swap(merged_);
  decltype(pending_)().swap(pending_);
}

bool CrossLayerImportance::gathers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gather_ != nullptr;
}

bool CrossLayerImportance::holds_posts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& row : entries_) {
    if (!row.empty()) return true;
  }
  for (const auto& layer : pending_) {
    for (const auto& row : layer) {
      if (!row.empty()) return true;
    }
  }
  return false;
}

std::shared_ptr<void> CrossLayerImportance::attachment(const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!attachment_) attachment_ = make();
  return attachment_;
}

std::size_t CrossLayerImportance::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = merged_.capacity() * sizeof(Entry);
  for (const auto& e : entries_) total += e.capacity() * sizeof(Entry);
  for (const auto& layer : pending_) {
    for (const auto& row : layer) total += row.capacity() * sizeof(std::pair<std::int64_t, float>);
  }
  return total;
}

}  // namespace kvslim
