#include "eviction_cache.h"
#include "cache/observation_check.h"

#include <algorithm>

#include "attend/head_attention.h"

namespace kvslim {

EvictionCache::EvictionCache(std::string method, EvictionPolicy policy, std::size_t budget,
                             std::unique_ptr<RowStorage> storage)
    : intake_(method), core_(policy, std::move(storage)), budget_(budget), method_(std::move(method)) {}

bool EvictionCache::attention_scored() const {
  return !core_.fell_back() && scores_by_attention(core_.policy().scoring);
}

void EvictionCache::append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) {
  intake_.take(keys, values, positions);
  before_absorb(intake_);
  hold_while_uncertain();
  core_.absorb(intake_.batch(), intake_.heads(), intake_.head_dim(), intake_.keys(), intake_.values(),
               intake_.positions(), intake_.tokens(), eviction_limit());
  if (!attention_scored()) after_step();
}

void EvictionCache::attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                           float* probs, const ParallelFor* parallel) const {
  const std::size_t heads = core_.heads();
  attend::run(method_, core_.batch(), heads, core_.dim(), core_.rows(), queries,
              query_positions, out, probs, parallel,
              [&](attend::HeadAttention& head, std::size_t b, std::size_t g) { core_.feed(head, b * heads + g); });
}

void EvictionCache::observe_attention(const AttentionObservation& obs) {
  if (!attention_scored()) return;
  hold_while_uncertain();
  core_.observe(obs, eviction_limit(), method_ + " cache");
  after_step();
}

ObservationNeeds eviction_needs(const EvictionCore& core) {
  ObservationNeeds n;
  n.attention = !core.fell_back() && scores_by_attention(core.policy().scoring);
  // An observation window reads only the last obs_window queries of a prefill; at least 2 are
  // asked for, so that the trimmed observation still reads as a prefill (pooling, cross-layer).
  if (n.attention && core.policy().obs_window > 0) n.attention_queries = std::max<std::size_t>(core.policy().obs_window, 2);
  return n;
}

ObservationNeeds EvictionCache::needs() const { return eviction_needs(core_); }

void EvictionCache::hold_while_uncertain() {
  // A limit above the budget (squeeze's deferred prefill) may still cut the rows above the budget.
  core_.hold_compression_above(eviction_limit() > budget_ ? budget_ : EvictionPolicy::kUnbounded);
}

void EvictionCache::rebudget(std::size_t budget) {
  budget_ = budget;
  hold_while_uncertain();
  core_.trim(budget);
}

void EvictionCache::reset() {
  intake_.reset();
  core_.reset();
}

CacheStats EvictionCache::stats() const {
  CacheStats st;
  st.method = method_;
  st.batch = intake_.batch();
  st.heads = intake_.heads();
  st.head_dim = intake_.head_dim();
  st.tokens_seen = intake_.tokens_seen();
  st.tokens_kept = core_.rows();
  st.kept_per_head.assign(st.batch * st.heads, core_.rows());
  st.resident_bytes = core_.resident_bytes();
  st.view_bytes = core_.storage().view_bytes();
  const std::size_t per_token = st.batch * st.heads * st.head_dim * 2 * sizeof(std::uint16_t);
  st.kept_fp16_bytes = st.tokens_kept * per_token;
  st.seen_fp16_bytes = static_cast<std::size_t>(st.tokens_seen) * per_token;
  st.accounted_bytes = static_cast<double>(st.kept_fp16_bytes);  // the original counts kept rows at fp16
  st.compression_ratio = st.resident_bytes == 0 ? 1.0 : static_cast<double>(st.seen_fp16_bytes) / st.resident_bytes;
  if (budget_ != EvictionPolicy::kUnbounded) st.figures.emplace_back("layer_budget", static_cast<double>(budget_));
  st.figures.emplace_back("original_compression_ratio",
                          st.kept_fp16_bytes == 0 ? 1.0 : static_cast<double>(st.seen_fp16_bytes) / st.kept_fp16_bytes);
  core_.storage().add_figures(st);
  add_figures(st);
  return st;
}

}  // namespace kvslim
