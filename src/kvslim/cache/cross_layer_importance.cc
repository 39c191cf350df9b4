#include "cross_layer_importance.h"

#include <algorithm>

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
  if (entries_.size() <= batch_row) entries_.resize(batch_row + 1);
  std::vector<Entry>& e = entries_[batch_row];
  const auto L = static_cast<std::uint32_t>(layer);
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
  // Sorted merge of the board's entries and the posted positions (both ascending).
  merged_.clear();
  merged_.reserve(e.size() + n);
  std::size_t j = 0;
  for (std::size_t i = 0; i < n; ++i) {
    while (j < e.size() && e[j].position < positions[i]) merged_.push_back(e[j++]);
    if (!merged_.empty() && merged_.back().position == positions[i]) {
      add(merged_.back(), values[i]);  // a position repeated within one post
    } else if (j < e.size() && e[j].position == positions[i]) {
      merged_.push_back(e[j++]);
      add(merged_.back(), values[i]);
    } else {
      merged_.push_back(Entry{positions[i], values[i], 0.0f, L});
    }
  }
  while (j < e.size()) merged_.push_back(e[j++]);
  e.swap(merged_);
}

void CrossLayerImportance::leave(std::size_t layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (layer >= layers_) return;
  left_[layer] = 1;
  if (std::all_of(left_.begin(), left_.end(), [](char c) { return c != 0; })) clear_storage();
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
}

std::size_t CrossLayerImportance::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t total = merged_.capacity() * sizeof(Entry);
  for (const auto& e : entries_) total += e.capacity() * sizeof(Entry);
  return total;
}

}  // namespace kvslim
