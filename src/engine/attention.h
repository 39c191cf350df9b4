// Grouped-query attention over a kvslim CacheView: fp16 rows in any order, each with its absolute
// position; a query at position p sees the rows whose position is <= p. Also assembles the
// "full prompt" view (previous view + the chunk's own rows) and the attention observation.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/ops.h"
#include "kvslim/cache.h"

namespace kvslim::engine {

// How a prefill chunk's queries see the chunk itself.
enum class PrefillAttention {
  cache_view,   // attend over what update_and_fetch returns (evict-while-prefilling, documented)
  full_prompt,  // attend over the previous view plus the whole chunk, then let the cache absorb it
};
PrefillAttention parse_prefill_attention(std::string_view text);  // throws std::invalid_argument
std::string_view prefill_attention_name(PrefillAttention mode);

class Attention {
 public:
  // heads % kv_heads must be 0. Scratch is sized for `max_queries` x `max_rows` and grows (never
  // shrinks) when a longer call arrives, so steady decode allocates nothing.
  Attention(int heads, int kv_heads, int head_dim, std::size_t max_queries, std::size_t max_rows);

  // out[s, h, :] = sum_i softmax_i(q[s,h]·K[g,i] / sqrt(D), masked) V[g,i], g = h / (H / H_kv).
  // q, out: [S, H, D]; query_positions: [S]. `view` must have batch 1, heads == kv_heads,
  // head_dim == D. When `observation` is non-null it receives the probabilities summed over the
  // query heads of each group: [H_kv, S, view.tokens] (row stride view.tokens). A query that sees
  // no row (every row evicted or in its future) gets a zero output and zero probabilities.
  void attend(const CacheView& view, const float* q, std::span<const std::int64_t> query_positions,
              float* out, float* observation, ThreadPool* pool = nullptr);

  // The previous view's rows of each KV head followed by the chunk's rows (rounded to fp16 as the
  // cache would store them): keys/values [H_kv, S, D] fp32, positions [S]. Valid until the next call.
  CacheView concat(const CacheView& previous, const float* keys, const float* values,
                   std::span<const std::int64_t> positions);

  // Maps observation columns from `from` (e.g. the concatenated view) to the rows of `to` (the
  // cache's view after it absorbed the chunk) by position: out [H_kv, S, to.tokens].
  void remap_observation(const CacheView& from, const float* from_probs, std::size_t queries,
                         const CacheView& to, float* out);

  std::size_t observation_size(std::size_t queries, std::size_t rows) const {
    return static_cast<std::size_t>(kv_heads_) * queries * rows;
  }

 private:
  // Prefill (sgemm) path, one task: KV head g, queries [s0, s0 + nb), every query head of g.
  // keys/values: that head's rows as fp32 [rows, D]; scores: scratch [nb, rows].
  void attend_block_gemm(const CacheView& view, int g, std::size_t s0, std::size_t nb, const float* keys,
                         const float* values, bool in_order, const float* q, std::span<const std::int64_t> qpos,
                         float* out, float* obs, float* scores) const;
  void attend_head_group_rows(const CacheView& view, int g, const float* q,
                              std::span<const std::int64_t> qpos, float* out, float* obs);

  int heads_, kv_heads_, head_dim_, group_;
  float scale_;
  std::vector<float> k_f32_, v_f32_;   // [H_kv, rows, D]: the rows converted for the sgemm path
  std::vector<float> scores_;          // [max(H * rows, block * rows)] scores / probabilities
  std::vector<std::uint16_t> cat_k_, cat_v_;  // [H_kv, rows + S, D] fp16: concatenated view
  std::vector<std::int64_t> cat_pos_;         // [H_kv, rows + S]
  std::vector<std::pair<std::int64_t, std::uint32_t>> pos_index_;  // [rows]: (position, column)
};

}  // namespace kvslim::engine
