#include "engine/tee_cache.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

namespace kvslim::engine {

TeeCache::TeeCache(KVCache* primary, std::vector<KVCache*> followers) : primary_(primary) {
  if (primary == nullptr) throw std::invalid_argument("tee cache: no primary cache");
  all_.push_back(primary);
  name_ = "tee(";
  name_ += primary->method();
  for (KVCache* f : followers) {
    if (f == nullptr) throw std::invalid_argument("tee cache: a follower cache is null");
    all_.push_back(f);
    name_ += '+';
    name_ += f->method();
  }
  name_ += ')';
  set_layer_id(primary->layer_id());
}

void TeeCache::append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) {
  for (KVCache* c : all_) c->append(keys, values, positions);
}

void TeeCache::attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                      float* probs, const ParallelFor* parallel) const {
  primary_->attend(queries, query_positions, out, probs, parallel);
}

void TeeCache::reset() {
  for (KVCache* c : all_) c->reset();
}

void TeeCache::reserve(std::size_t tokens) {
  for (KVCache* c : all_) c->reserve(tokens);
}

ObservationNeeds TeeCache::needs() const {
  ObservationNeeds u;
  bool every_query = false;
  for (const KVCache* c : all_) {
    const ObservationNeeds n = c->needs();
    u.hidden_states = u.hidden_states || n.hidden_states;
    if (!n.attention) continue;
    u.attention = true;
    every_query = every_query || n.attention_queries == 0;
    u.attention_queries = std::max(u.attention_queries, n.attention_queries);
  }
  if (every_query) u.attention_queries = 0;
  return u;
}

void TeeCache::check_same_rows(const KVCache& follower) const {
  const CacheView p = primary_->materialize(), f = follower.materialize();
  bool same = p.tokens == f.tokens && p.heads == f.heads && p.batch == f.batch;
  for (std::size_t b = 0; same && b < p.batch; ++b) {
    for (std::size_t h = 0; same && h < p.heads; ++h) {
      const std::int64_t* pp = p.positions + p.head_index(b, h) * p.head_stride;
      const std::int64_t* fp = f.positions + f.head_index(b, h) * f.head_stride;
      same = std::equal(pp, pp + p.tokens, fp);
    }
  }
  if (!same) {
    throw std::logic_error("tee cache: layer " + std::to_string(layer_id()) + "'s " + std::string(follower.method()) +
                           " keeps " + std::to_string(f.tokens) + " rows, not the " + std::to_string(p.tokens) +
                           " rows of " + std::string(primary_->method()) +
                           " that the observation covers: a shared prefill must be one call into empty caches");
  }
}

void TeeCache::observe_attention(const AttentionObservation& observation) {
  for (KVCache* c : all_) {
    if (!c->needs().attention) continue;
    if (c != primary_) check_same_rows(*c);
    c->observe_attention(observation);
  }
}

void TeeCache::observe_hidden(const HiddenObservation& observation) {
  for (KVCache* c : all_) {
    if (c->needs().hidden_states) c->observe_hidden(observation);
  }
}

CacheSet tee_cache_set(const CacheSet& primary, const std::vector<const CacheSet*>& followers) {
  std::vector<std::unique_ptr<KVCache>> layers(primary.size());
  for (std::size_t l = 0; l < primary.size(); ++l) {
    std::vector<KVCache*> f;
    for (const CacheSet* set : followers) {
      if (set == nullptr || set->size() != primary.size() || ((*set)[l] == nullptr) != (primary[l] == nullptr)) {
        throw std::invalid_argument("tee cache set: the follower sets do not have the primary's layers");
      }
      if (primary[l] != nullptr) f.push_back((*set)[l]);
    }
    if (primary[l] != nullptr) layers[l] = std::make_unique<TeeCache>(primary[l], std::move(f));
  }
  return CacheSet::of_layers(std::move(layers));
}

}  // namespace kvslim::engine
