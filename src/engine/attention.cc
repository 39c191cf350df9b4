#include "engine/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvslim/convert.h"

namespace kvslim::engine {

namespace {

// Queries per sgemm block in the prefill path: bounds the score scratch to kQueryBlock x rows.
constexpr std::size_t kQueryBlock = 64;
// Below this many (query, head) pairs per KV head, converting the rows to fp32 for sgemm costs
// more than reading them as fp16 per query.
constexpr std::size_t kGemmMinQueries = 8;

template <class T>
void ensure(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(std::max(n, v.size() + v.size() / 2));
}

// Sets scores of rows in the query's future to -inf; returns how many rows the query sees.
std::size_t mask_future(float* scores, const std::int64_t* row_pos, std::size_t n, std::int64_t qpos) {
  std::size_t visible = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (row_pos[i] > qpos) {
      scores[i] = -INFINITY;
    } else {
      ++visible;
    }
  }
  return visible;
}

}  // namespace

PrefillAttention parse_prefill_attention(std::string_view text) {
  if (text == "cache_view") return PrefillAttention::cache_view;
  if (text == "full_prompt") return PrefillAttention::full_prompt;
  throw std::invalid_argument("prefill_attention '" + std::string(text) +
                              "': expected cache_view or full_prompt");
}

std::string_view prefill_attention_name(PrefillAttention mode) {
  return mode == PrefillAttention::cache_view ? "cache_view" : "full_prompt";
}

Attention::Attention(int heads, int kv_heads, int head_dim, std::size_t max_queries, std::size_t max_rows)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
  if (heads <= 0 || kv_heads <= 0 || head_dim <= 0 || heads % kv_heads != 0) {
    throw std::invalid_argument("attention: heads " + std::to_string(heads) + " must be a positive multiple of kv_heads " +
                                std::to_string(kv_heads));
  }
  group_ = heads / kv_heads;
  scale_ = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const std::size_t d = static_cast<std::size_t>(head_dim);
  k_f32_.resize(max_rows * d);
  v_f32_.resize(max_rows * d);
  scores_.resize(std::max(static_cast<std::size_t>(heads), std::min(max_queries, kQueryBlock)) * max_rows);
}

void Attention::attend(const CacheView& view, const float* q, std::span<const std::int64_t> qpos,
                       float* out, float* observation, ThreadPool* pool) {
  if (view.batch != 1 || view.heads != static_cast<std::size_t>(kv_heads_) ||
      view.head_dim != static_cast<std::size_t>(head_dim_)) {
    throw std::invalid_argument("attention: cache view is [" + std::to_string(view.batch) + ", " +
                                std::to_string(view.heads) + ", *, " + std::to_string(view.head_dim) +
                                "], expected [1, " + std::to_string(kv_heads_) + ", *, " +
                                std::to_string(head_dim_) + "]");
  }
  const std::size_t n_q = qpos.size(), rows = view.tokens, d = head_dim_;
  if (observation != nullptr) std::fill_n(observation, observation_size(n_q, rows), 0.0f);
  if (rows == 0) {  // nothing to attend to (e.g. every row evicted)
    std::fill_n(out, n_q * heads_ * d, 0.0f);
    return;
  }
  if (n_q * group_ >= kGemmMinQueries) {
    const std::size_t hk = static_cast<std::size_t>(kv_heads_);
    ensure(k_f32_, hk * rows * d);
    ensure(v_f32_, hk * rows * d);
    for (std::size_t g = 0; g < hk; ++g) {
      convert_fp16_to_f32(view.key_row(0, g, 0), k_f32_.data() + g * rows * d, rows * d);
      convert_fp16_to_f32(view.value_row(0, g, 0), v_f32_.data() + g * rows * d, rows * d);
    }
    const std::size_t blocks = (n_q + kQueryBlock - 1) / kQueryBlock;
    auto task = [&](int t, float* scores) {
      const int g = static_cast<int>(static_cast<std::size_t>(t) / blocks);
      const std::size_t s0 = (static_cast<std::size_t>(t) % blocks) * kQueryBlock;
      const std::int64_t* row_pos = view.positions + view.head_index(0, g) * view.head_stride;
      // Rows in position order (a prompt in a full cache, the kept rows of every eviction
      // cache): a query block sees a prefix of them, so the products stop at its newest query.
      const bool in_order = std::is_sorted(row_pos, row_pos + rows);
      attend_block_gemm(view, g, s0, std::min(kQueryBlock, n_q - s0), k_f32_.data() + g * rows * d,
                        v_f32_.data() + g * rows * d, in_order, q, qpos, out, observation, scores);
    };
    const int tasks = static_cast<int>(hk * blocks);
    if (pool != nullptr && pool->threads() > 1 && tasks > 1) {
      // One (KV head, query block) product is small: OpenBLAS's own threads cost more than they
      // give there, so the tasks spread over the engine's pool with a single-threaded BLAS.
      // A task owns its queries' output and observation rows (every query head of its KV head).
      const int blas_threads = openblas_get_num_threads();
      openblas_set_num_threads(1);
      auto run = [&](int t) {
        thread_local std::vector<float> scratch;  // [kQueryBlock, rows]
        ensure(scratch, kQueryBlock * rows);
        task(t, scratch.data());
      };
      pool->for_each(tasks, run);
      openblas_set_num_threads(blas_threads);
    } else {
      ensure(scores_, std::min(n_q, kQueryBlock) * rows);
      for (int t = 0; t < tasks; ++t) task(t, scores_.data());
    }
    return;
  }
  ensure(scores_, static_cast<std::size_t>(heads_) * rows * n_q);
  auto group = [&](int g) { attend_head_group_rows(view, g, q, qpos, out, observation); };
  if (pool != nullptr && rows * d * kv_heads_ >= (1u << 15)) {
    pool->for_each(kv_heads_, group);
  } else {
    for (int g = 0; g < kv_heads_; ++g) group(g);
  }
}

// Prefill: Q·K^T and P·V as sgemm for the query heads of KV head g, queries [s0, s0 + nb).
void Attention::attend_block_gemm(const CacheView& view, int g, std::size_t s0, std::size_t nb, const float* keys,
                                  const float* values, bool in_order, const float* q,
                                  std::span<const std::int64_t> qpos, float* out, float* obs, float* scores) const {
  const std::size_t n_q = qpos.size(), rows = view.tokens, d = head_dim_, hd = heads_ * d;
  const std::int64_t* row_pos = view.positions + view.head_index(0, g) * view.head_stride;
  std::size_t seen = rows;  // rows any query of the block can see: the columns computed
  if (in_order) {
    const std::int64_t newest = *std::max_element(qpos.begin() + s0, qpos.begin() + s0 + nb);
    seen = static_cast<std::size_t>(std::upper_bound(row_pos, row_pos + rows, newest) - row_pos);
  }
  for (int j = 0; j < group_; ++j) {
    const std::size_t h = static_cast<std::size_t>(g) * group_ + j;
    if (seen == 0) {  // the whole block precedes every row
      for (std::size_t s = 0; s < nb; ++s) std::fill_n(out + (s0 + s) * hd + h * d, d, 0.0f);
      continue;
    }
    // scores [nb, seen] = scale * Q[s0:s0+nb, h] · K[:seen]^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(nb), static_cast<int>(seen),
                static_cast<int>(d), scale_, q + s0 * hd + h * d, static_cast<int>(hd), keys, static_cast<int>(d),
                0.0f, scores, static_cast<int>(seen));
    for (std::size_t s = 0; s < nb; ++s) {
      float* row = scores + s * seen;
      if (mask_future(row, row_pos, seen, qpos[s0 + s]) == 0) {
        std::fill_n(row, seen, 0.0f);
        continue;
      }
      softmax(row, seen);
      if (obs != nullptr) {  // columns from `seen` on keep their 0: those rows are unseen
        float* o = obs + (static_cast<std::size_t>(g) * n_q + s0 + s) * rows;
        for (std::size_t i = 0; i < seen; ++i) o[i] += row[i];
      }
    }
    // out[s0:s0+nb, h] = P · V[:seen]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(nb), static_cast<int>(d),
                static_cast<int>(seen), 1.0f, scores, static_cast<int>(seen), values, static_cast<int>(d), 0.0f,
                out + s0 * hd + h * d, static_cast<int>(hd));
  }
}

// Decode: fp16 rows read directly (dot products, then a weighted sum), one query at a time.
void Attention::attend_head_group_rows(const CacheView& view, int g, const float* q,
                                       std::span<const std::int64_t> qpos, float* out, float* obs) {
  const std::size_t n_q = qpos.size(), rows = view.tokens, d = head_dim_, hd = heads_ * d;
  const std::int64_t* row_pos = view.positions + view.head_index(0, g) * view.head_stride;
  for (int j = 0; j < group_; ++j) {
    const std::size_t h = static_cast<std::size_t>(g) * group_ + j;
    for (std::size_t s = 0; s < n_q; ++s) {
      float* scores = scores_.data() + (h * n_q + s) * rows;  // [rows]
      float* o = out + s * hd + h * d;                          // [D]
      std::fill_n(o, d, 0.0f);
      dot_fp16_rows(view.key_row(0, g, 0), rows, d, d, q + s * hd + h * d, scores);
      for (std::size_t i = 0; i < rows; ++i) scores[i] *= scale_;
      if (mask_future(scores, row_pos, rows, qpos[s]) == 0) continue;
      softmax(scores, rows);
      for (std::size_t i = 0; i < rows; ++i) {
        if (scores[i] != 0.0f) axpy_fp16_row(scores[i], view.value_row(0, g, i), d, o);
      }
      if (obs != nullptr) {
        float* ob = obs + (static_cast<std::size_t>(g) * n_q + s) * rows;
        for (std::size_t i = 0; i < rows; ++i) ob[i] += scores[i];
      }
    }
  }
}

CacheView Attention::concat(const CacheView& previous, const float* keys, const float* values,
                            std::span<const std::int64_t> positions) {
  const std::size_t n_old = previous.tokens, s = positions.size(), n = n_old + s, d = head_dim_;
  const std::size_t hk = static_cast<std::size_t>(kv_heads_);
  if (n_old > 0 && (previous.heads != hk || previous.head_dim != d || previous.batch != 1)) {
    throw std::invalid_argument("attention: previous cache view does not match the layer's KV heads");
  }
  ensure(cat_k_, hk * n * d);
  ensure(cat_v_, hk * n * d);
  ensure(cat_pos_, hk * n);
  for (std::size_t g = 0; g < hk; ++g) {
    std::uint16_t* k = cat_k_.data() + g * n * d;
    std::uint16_t* v = cat_v_.data() + g * n * d;
    std::int64_t* p = cat_pos_.data() + g * n;
    if (n_old > 0) {
      std::memcpy(k, previous.key_row(0, g, 0), n_old * d * sizeof(std::uint16_t));
      std::memcpy(v, previous.value_row(0, g, 0), n_old * d * sizeof(std::uint16_t));
      std::memcpy(p, previous.positions + previous.head_index(0, g) * previous.head_stride,
                  n_old * sizeof(std::int64_t));
    }
    convert_f32_to_fp16(keys + g * s * d, k + n_old * d, s * d);
    convert_f32_to_fp16(values + g * s * d, v + n_old * d, s * d);
    std::copy(positions.begin(), positions.end(), p + n_old);
  }
  CacheView view;
  view.batch = 1;
  view.heads = hk;
  view.tokens = n;
  view.head_dim = d;
  view.head_stride = n;
  view.keys = cat_k_.data();
  view.values = cat_v_.data();
  view.positions = cat_pos_.data();
  return view;
}

void Attention::remap_observation(const CacheView& from, const float* from_probs, std::size_t queries,
                                  const CacheView& to, float* out) {
  ensure(pos_index_, from.tokens);
  for (std::size_t g = 0; g < to.heads; ++g) {
    const std::int64_t* fp = from.positions + from.head_index(0, g) * from.head_stride;
    auto index = std::span(pos_index_.data(), from.tokens);
    for (std::size_t i = 0; i < from.tokens; ++i) index[i] = {fp[i], static_cast<std::uint32_t>(i)};
    std::sort(index.begin(), index.end());
    for (std::size_t r = 0; r < to.tokens; ++r) {
      const std::int64_t pos = to.position(0, g, r);
      auto it = std::lower_bound(index.begin(), index.end(), std::pair<std::int64_t, std::uint32_t>{pos, 0});
      const bool found = it != index.end() && it->first == pos;
      for (std::size_t s = 0; s < queries; ++s) {
        out[(g * queries + s) * to.tokens + r] =
            found ? from_probs[(g * queries + s) * from.tokens + it->second] : 0.0f;
      }
    }
  }
}

}  // namespace kvslim::engine
