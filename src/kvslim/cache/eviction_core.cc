#include "eviction_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "kernels.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"

namespace kvslim {

Scoring parse_scoring(const std::string& name) {
  if (name == "key_proxy") return Scoring::key_proxy;
  if (name == "attention") return Scoring::attention;
  if (name == "attention_normalized") return Scoring::attention_normalized;
  if (name == "none") return Scoring::none;
  throw ConfigError("evict_scoring = \"" + name + "\": must be one of key_proxy, attention, attention_normalized");
}

namespace {
bool attention_scored(Scoring s) { return s == Scoring::attention || s == Scoring::attention_normalized; }
// Below this much scoring work per call (multiply-adds) a second thread costs more than it saves.
constexpr double kThreadWork = 4e6;
}  // namespace

std::int64_t EvictionCore::recent_threshold() const {
  return recent_.empty() ? std::numeric_limits<std::int64_t>::max() : recent_.front();
}

void EvictionCore::absorb(std::size_t batch, std::size_t heads, std::size_t dim, const std::uint16_t* keys16,
                          const std::uint16_t* values16, const std::int64_t* positions, std::size_t S,
                          std::size_t limit) {
  if (batch_ == 0) {
    batch_ = batch;
    heads_ = heads;
    dim_ = dim;
  }
  const bool append_only = attention_scored(policy_.scoring);
  // Attention scorings evict in observe(). An engine that skipped it left more than `limit` rows:
  // evict by the scores observed so far, so the budget holds whatever the caller forgets.
  if (append_only && limit != EvictionPolicy::kUnbounded && rows_ > limit) drop_lowest(rows_ - limit);
  const std::size_t needed = append_only ? rows_ + S : std::min(rows_ + S, limit);
  // Growth bound: geometric without a limit (full: amortised O(1) copies per row), the budget plus
  // the one row a decode step appends before observe() for attention scorings, else the budget.
  std::size_t bound = EvictionPolicy::kUnbounded;
  if (limit != EvictionPolicy::kUnbounded) bound = std::max(needed, append_only ? limit + 1 : limit);
  reserve_rows(needed, bound);

  // The recent-window threshold after each token: rows at or above it are protected.
  thresholds_.resize(S);
  for (std::size_t s = 0; s < S; ++s) {
    if (policy_.recent_window > 0) {
      recent_.push_back(positions[s]);
      if (recent_.size() > policy_.recent_window) recent_.pop_front();
    }
    thresholds_[s] = recent_threshold();
  }

  const std::size_t total = heads_total();
  const double work = static_cast<double>(S) * static_cast<double>(needed) * static_cast<double>(dim) *
                      static_cast<double>(total);
  if (policy_.scoring == Scoring::key_proxy && total >= 2 && work >= kThreadWork) {
    const std::size_t half = total / 2;
    Scratch other;
    std::thread worker([&] { absorb_heads(half, total, keys16, values16, positions, S, limit, thresholds_.data(), other); });
    absorb_heads(0, half, keys16, values16, positions, S, limit, thresholds_.data(), scratch_);
    worker.join();
  } else {
    absorb_heads(0, total, keys16, values16, positions, S, limit, thresholds_.data(), scratch_);
  }
  rows_ = head_rows_;
}

void EvictionCore::absorb_heads(std::size_t head_begin, std::size_t head_end, const std::uint16_t* keys16,
                                const std::uint16_t* values16, const std::int64_t* positions, std::size_t S,
                                std::size_t limit, const std::int64_t* recent_threshold, Scratch& scratch) {
  const std::size_t D = dim_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  scratch.query.resize(D);
  if (scratch.logits.size() < capacity_) scratch.logits.resize(capacity_);
  const bool newcomer_protected = policy_.recent_window > 0;
  std::size_t final_rows = rows_;
  for (std::size_t head = head_begin; head < head_end; ++head) {
    std::size_t n = rows_;
    float* scores = scores_.data() + head * capacity_;
    for (std::size_t s = 0; s < S; ++s) {
      const std::uint16_t* k = keys16 + (head * S + s) * D;
      const std::uint16_t* v = values16 + (head * S + s) * D;
      if (attention_scored(policy_.scoring)) {
        write_row(head, n++, k, v, positions[s], 0.0f);
        continue;
      }
      if (n == 0) {  // bootstrap: the first token scores 1.0 and is never checked against the budget
        write_row(head, 0, k, v, positions[s], 1.0f);
        n = 1;
        continue;
      }
      if (policy_.scoring == Scoring::key_proxy) {
        // The fp16-rounded incoming key is the query; softmax in fp32 over the stored rows.
        convert_fp16_to_f32(k, scratch.query.data(), D);
        dot_fp16_rows(keys_.data() + head * capacity_ * D, n, D, D, scratch.query.data(), scratch.logits.data());
        kernels::softmax_accumulate(scratch.logits.data(), n, scale, scores);
      }
      if (n < limit) {
        write_row(head, n++, k, v, positions[s], 0.0f);
        continue;
      }
      // Over the limit: evict the lowest score among the stored rows and the newcomer (score 0,
      // highest position, so it loses every tie).
      const std::size_t victim = pick_victim(head, n, recent_threshold[s]);
      if (!newcomer_protected && (victim == kNone || effective_score(head, victim) > 0.0f)) continue;
      if (victim == kNone) throw std::logic_error("eviction core: no evictable row (sinks + recent window >= budget)");
      write_row(head, victim, k, v, positions[s], 0.0f);
    }
    final_rows = n;
  }
  if (head_begin == 0) head_rows_ = final_rows;  // every head ends with the same count
}

void EvictionCore::write_row(std::size_t head, std::size_t slot, const std::uint16_t* k, const std::uint16_t* v,
                             std::int64_t position, float score) {
  const std::size_t row = head * capacity_ + slot;
  std::memcpy(keys_.data() + row * dim_, k, dim_ * sizeof(std::uint16_t));
  std::memcpy(values_.data() + row * dim_, v, dim_ * sizeof(std::uint16_t));
  positions_[row] = position;
  scores_[row] = score;
  if (!exposure_.empty()) exposure_[row] = 0.0f;
}

void EvictionCore::move_row(std::size_t head, std::size_t from, std::size_t to) {
  const std::size_t src = head * capacity_ + from, dst = head * capacity_ + to;
  std::memcpy(keys_.data() + dst * dim_, keys_.data() + src * dim_, dim_ * sizeof(std::uint16_t));
  std::memcpy(values_.data() + dst * dim_, values_.data() + src * dim_, dim_ * sizeof(std::uint16_t));
  positions_[dst] = positions_[src];
  scores_[dst] = scores_[src];
  if (!exposure_.empty()) exposure_[dst] = exposure_[src];
}

float EvictionCore::effective_score(std::size_t head, std::size_t slot) const {
  const std::size_t row = head * capacity_ + slot;
  if (policy_.scoring == Scoring::attention_normalized) {
    return exposure_[row] > 0.0f ? scores_[row] / exposure_[row] : 0.0f;
  }
  return scores_[row];
}

std::size_t EvictionCore::pick_victim(std::size_t head, std::size_t n, std::int64_t recent_threshold) const {
  const std::int64_t* pos = positions_.data() + head * capacity_;
  std::size_t best = kNone;
  float best_score = 0.0f;
  for (std::size_t j = policy_.n_sink; j < n; ++j) {
    if (pos[j] >= recent_threshold) continue;
    const float s = effective_score(head, j);
    if (best == kNone || s < best_score || (s == best_score && pos[j] < pos[best])) {
      best = j;
      best_score = s;
    }
  }
  return best;
}

void EvictionCore::observe(const AttentionObservation& obs, std::size_t limit) {
  if (obs.batch != batch_ || obs.heads != heads_ || obs.tokens != rows_ || obs.probs == nullptr ||
      obs.stride < obs.tokens || (!obs.query_positions.empty() && obs.query_positions.size() != obs.queries)) {
    throw InputError("attention observation [" + std::to_string(obs.batch) + ", " + std::to_string(obs.heads) + ", " +
                     std::to_string(obs.queries) + ", " + std::to_string(obs.tokens) + "] does not match the view [" +
                     std::to_string(batch_) + ", " + std::to_string(heads_) + ", q, " + std::to_string(rows_) +
                     "] of the last update_and_fetch");
  }
  const bool normalized = policy_.scoring == Scoring::attention_normalized;
  for (std::size_t head = 0; head < heads_total(); ++head) {
    float* scores = scores_.data() + head * capacity_;
    const std::int64_t* pos = positions_.data() + head * capacity_;
    for (std::size_t q = 0; q < obs.queries; ++q) {
      kernels::add_f32(obs.probs + (head * obs.queries + q) * obs.stride, rows_, scores);
      if (!normalized) continue;
      float* exposure = exposure_.data() + head * capacity_;
      const std::int64_t qpos = obs.query_positions.empty() ? std::numeric_limits<std::int64_t>::max() : obs.query_positions[q];
      for (std::size_t i = 0; i < rows_; ++i) exposure[i] += pos[i] <= qpos ? 1.0f : 0.0f;
    }
  }
  if (rows_ > limit) drop_lowest(rows_ - limit);
  // A prefill appended the whole prompt before this eviction: give back what the budget (plus the
  // one row a decode step appends before it is observed) does not need.
  if (limit != EvictionPolicy::kUnbounded && capacity_ > limit + 1 + limit / 8) relayout(std::max(rows_, limit + 1));
}

void EvictionCore::drop_lowest(std::size_t drop) {
  const std::int64_t threshold = recent_threshold();
  for (std::size_t head = 0; head < heads_total(); ++head) {
    const std::int64_t* pos = positions_.data() + head * capacity_;
    holes_.clear();
    if (drop == 1) {
      const std::size_t victim = pick_victim(head, rows_, threshold);
      if (victim == kNone) throw std::logic_error("eviction core: no evictable row to drop");
      holes_.push_back(victim);
    } else {
      candidates_.clear();
      for (std::size_t j = policy_.n_sink; j < rows_; ++j) {
        if (pos[j] < threshold) candidates_.push_back(j);
      }
      if (candidates_.size() < drop) throw std::logic_error("eviction core: fewer evictable rows than must go");
      auto lower = [&](std::size_t a, std::size_t b) {
        const float sa = effective_score(head, a), sb = effective_score(head, b);
        return sa < sb || (sa == sb && pos[a] < pos[b]);
      };
      std::nth_element(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(drop - 1), candidates_.end(), lower);
      holes_.assign(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(drop));
      std::sort(holes_.begin(), holes_.end());
    }
    // Fill each hole with the last live row: O(drop * D) moves, sinks (the leading slots) stay put.
    std::size_t last = rows_;  // one past the last candidate for moving
    std::size_t tail_hole = holes_.size();
    for (std::size_t h = 0; h < holes_.size(); ++h) {
      const std::size_t hole = holes_[h];
      while (last > 0 && tail_hole > h && holes_[tail_hole - 1] == last - 1) {
        --tail_hole;  // the row at the end is itself a hole: skip it
        --last;
      }
      if (h >= tail_hole || last == 0 || last - 1 <= hole) break;
      move_row(head, last - 1, hole);
      --last;
    }
  }
  rows_ -= drop;
}

void EvictionCore::trim(std::size_t budget) {
  if (rows_ > budget) drop_lowest(rows_ - budget);
  // Give back what the kept rows do not need (a deferred prefill may have held the whole prompt).
  const std::size_t keep = std::max(rows_, std::min(capacity_, budget));
  if (capacity_ > keep) relayout(keep);
}

void EvictionCore::reserve_rows(std::size_t needed, std::size_t bound) {
  if (needed <= capacity_) return;
  // x1.5: O(log n) moves over n appended rows, at most half the kept rows allocated and unused.
  std::size_t grown = std::max<std::size_t>(16, capacity_ + capacity_ / 2);
  relayout(std::max(needed, std::min(grown, bound)));
}

void EvictionCore::relayout(std::size_t new_capacity) {
  const std::size_t total = heads_total();
  const bool normalized = policy_.scoring == Scoring::attention_normalized;
  UninitBuffer<std::uint16_t> keys(total * new_capacity * dim_), values(total * new_capacity * dim_);
  UninitBuffer<float> scores(total * new_capacity);
  UninitBuffer<float> exposure(normalized ? total * new_capacity : 0);
  UninitBuffer<std::int64_t> positions(total * new_capacity);
  const std::size_t keep = std::min(rows_, new_capacity);
  for (std::size_t head = 0; head < total; ++head) {
    const std::size_t src = head * capacity_, dst = head * new_capacity;
    if (keep == 0) continue;
    std::memcpy(keys.data() + dst * dim_, keys_.data() + src * dim_, keep * dim_ * sizeof(std::uint16_t));
    std::memcpy(values.data() + dst * dim_, values_.data() + src * dim_, keep * dim_ * sizeof(std::uint16_t));
    std::memcpy(scores.data() + dst, scores_.data() + src, keep * sizeof(float));
    std::memcpy(positions.data() + dst, positions_.data() + src, keep * sizeof(std::int64_t));
    if (!exposure.empty()) std::memcpy(exposure.data() + dst, exposure_.data() + src, keep * sizeof(float));
  }
  keys_ = std::move(keys);
  values_ = std::move(values);
  scores_ = std::move(scores);
  exposure_ = std::move(exposure);
  positions_ = std::move(positions);
  capacity_ = new_capacity;
}

void EvictionCore::reset() {
  batch_ = heads_ = dim_ = 0;
  capacity_ = rows_ = head_rows_ = 0;
  keys_.release();
  values_.release();
  scores_.release();
  exposure_.release();
  positions_.release();
  recent_.clear();
}

CacheView EvictionCore::view() const {
  CacheView v;
  v.batch = batch_;
  v.heads = heads_;
  v.tokens = rows_;
  v.head_dim = dim_;
  v.head_stride = capacity_;
  v.keys = keys_.data();
  v.values = values_.data();
  v.positions = positions_.data();
  return v;
}

std::size_t EvictionCore::resident_bytes() const {
  return keys_.bytes() + values_.bytes() + scores_.bytes() + exposure_.bytes() + positions_.bytes();
}

}  // namespace kvslim
