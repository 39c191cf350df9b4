#include "kvslim/cache.h"
#include "kvslim/errors.h"

namespace kvslim {

void KVCache::attend_and_observe(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                                 float* probs, std::size_t kv_heads, const ParallelFor* parallel) {
  if (!needs().attention) {
    attend(queries, query_positions, out, nullptr, parallel);
    return;
  }
  if (probs == nullptr) {
    throw InputError(std::string(method()) + " cache: attend_and_observe needs a probabilities workspace "
                     "[batch, kv_heads, tokens, rows()] (probs is null)");
  }
  const std::size_t rows = this->rows();  // attend reads these; observe_attention may evict after
  attend(queries, query_positions, out, probs, parallel);
  observe_attention(AttentionObservation{probs, queries.batch, kv_heads, queries.tokens, rows, rows, query_positions,
                                         queries.space, queries.stream});
}

}  // namespace kvslim
