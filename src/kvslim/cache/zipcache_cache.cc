#include "cache/zipcache_cache.h"
#include "cache/observation_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "attend/head_attention.h"
#include "kvslim/errors.h"
#include "quant/group_quant.h"
#include "quant/quant_kernels.h"

namespace kvslim {

ZipCacheCache::ZipCacheCache(ZipCacheOptions options) : options_(std::move(options)), intake_(options_.method) {
  const std::string& m = options_.method;
  if (options_.hi_bits < 1 || options_.hi_bits > 8 || options_.lo_bits < 1 || options_.lo_bits > options_.hi_bits) {
    throw ConfigError(m + " cache: bits must satisfy 1 <= lo_bits <= hi_bits <= 8 (got lo " +
                      std::to_string(options_.lo_bits) + ", hi " + std::to_string(options_.hi_bits) + ")");
  }
  if (options_.value_bits != 0 && (options_.value_bits < 1 || options_.value_bits > 8)) {
    throw ConfigError(m + " cache: value_bits must be 0 (hi_bits) or in [1, 8] (got " + std::to_string(options_.value_bits) + ")");
  }
  if (!(options_.hi_fraction >= 0.0 && options_.hi_fraction <= 1.0)) {
    throw ConfigError(m + " cache: hi_fraction must be in [0, 1], got " + std::to_string(options_.hi_fraction));
  }
  if (options_.group_size == 0) throw ConfigError(m + " cache: group_size must be >= 1");
  if (options_.staging % options_.group_size != 0) {
    throw ConfigError(m + " cache: staging (" + std::to_string(options_.staging) + ") must be a multiple of group_size (" +
                      std::to_string(options_.group_size) + ")");
  }
}

void ZipCacheCache::reset() {
  intake_.reset();
  heads_.clear();
  positions_.clear();
  positions_.shrink_to_fit();
  staged_ = 0;
  max_block_elements_ = 0;
  accounted_key_bytes_ = accounted_value_bytes_ = baseline_key_bytes_ = fp16_key_bytes_ = 0;
}

void ZipCacheCache::append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) {
  intake_.take(keys, values, positions);  // validates everything before any state changes
  if (heads_.empty()) heads_.resize(intake_.batch() * intake_.heads());
  if (keys.dtype != DType::f16) max_block_elements_ = std::max(max_block_elements_, keys.elements());
  // Attention saliency: the window was scored by the attention observed since the last update.
  if (options_.attention_saliency) compress_ready();
  absorb_intake();
  if (!options_.attention_saliency) compress_ready();
}

void ZipCacheCache::attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                           float* probs, const ParallelFor* parallel) const {
  const std::size_t D = intake_.head_dim(), heads = intake_.heads();
  attend::run(options_.method, heads_.empty() ? 0 : intake_.batch(), heads, D, kept_tokens(), queries,
              query_positions, out, probs, parallel, [&](attend::HeadAttention& ha, std::size_t b, std::size_t g) {
                const Head& head = heads_[b * heads + g];
                std::size_t row = 0;
                for (const Block& block : head.blocks) {
                  ha.packed_block(block.keys, options_.quantize_values ? &block.values : nullptr,
                                  block.raw_values.data(), positions_.data() + row, block.newest, block.tokens, row);
                  row += block.tokens;
                }
                if (staged_ != 0) {
                  ha.fp16_rows(head.stage_keys.data(), head.stage_values.data(), D, positions_.data() + row, staged_,
                               row);
                }
              });
}

void ZipCacheCache::absorb_intake() {
  const std::size_t S = intake_.tokens(), D = intake_.head_dim(), n_heads = heads_.size();
  for (std::size_t bh = 0; bh < n_heads; ++bh) {
    Head& head = heads_[bh];
    const std::uint16_t* k = intake_.key_row(bh, 0);
    const std::uint16_t* v = intake_.value_row(bh, 0);
    head.stage_keys.insert(head.stage_keys.end(), k, k + S * D);
    head.stage_values.insert(head.stage_values.end(), v, v + S * D);
    if (options_.attention_saliency) {
      head.attention_sum.resize(staged_ + S, 0.0f);
      head.attention_queries.resize(staged_ + S, 0.0f);
    }
  }
  positions_.insert(positions_.end(), intake_.positions(), intake_.positions() + S);
  staged_ += S;

  // What the original would have accounted for this call: each call one block, per head.
  const double heads = static_cast<double>(n_heads);
  fp16_key_bytes_ += heads * static_cast<double>(S * D * 2);
  if (options_.method == "kivi") {
    // The original has no kivi cache: its uniform baseline formula (base_only_bytes) stands in.
    const double b = static_cast<double>(base_only_bytes(S, D, options_.hi_bits, options_.group_size));
    accounted_key_bytes_ += heads * b;
    accounted_value_bytes_ += heads * static_cast<double>(base_only_bytes(S, D, options_.values_at(), options_.group_size));
    baseline_key_bytes_ += heads * b;
  } else {
    const std::size_t n_hi = salient_count(S, options_.hi_fraction);
    accounted_key_bytes_ += heads * static_cast<double>(zipcache_accounted_bytes(
                                        n_hi, S - n_hi, S, D, options_.hi_bits, options_.lo_bits, options_.group_size));
    if (options_.quantize_values) {
      accounted_value_bytes_ += heads * static_cast<double>(zipcache_accounted_bytes(
                                            S, 0, S, D, options_.values_at(), options_.values_at(), options_.group_size));
    }
    baseline_key_bytes_ += heads * static_cast<double>(base_only_bytes(S, D, options_.lo_bits, options_.group_size));
  }
}

void ZipCacheCache::compress_ready() {
  if (staged_ == 0) return;
  if (options_.staging == 0) {
    compress_oldest(staged_);  // the documented behaviour: each call's tokens form one block
  } else if (staged_ >= options_.staging) {
    compress_oldest(staged_ / options_.group_size * options_.group_size);  // complete groups only
  }
}

void ZipCacheCache::compress_oldest(std::size_t count) {
  if (count == 0) return;
  const std::size_t D = intake_.head_dim();
  const auto& k = quant::simd_kernels();
  std::vector<const std::uint16_t*> key_rows(count), value_rows(count);
  std::vector<double> score(count);
  const auto first = positions_.begin() + static_cast<std::ptrdiff_t>(kept_tokens() - staged_);
  const std::int64_t newest = *std::max_element(first, first + static_cast<std::ptrdiff_t>(count));
  for (Head& head : heads_) {
    for (std::size_t s = 0; s < count; ++s) {
      key_rows[s] = head.stage_keys.data() + s * D;
      value_rows[s] = head.stage_values.data() + s * D;
    }
    if (options_.attention_saliency) {
      for (std::size_t s = 0; s < count; ++s) {
        score[s] = head.attention_queries[s] > 0 ? static_cast<double>(head.attention_sum[s]) / head.attention_queries[s] : 0.0;
      }
    } else {
      score = quant::row_norms_f16(key_rows.data(), count, D, k);
    }
    const auto mask = saliency_mask(score, options_.hi_fraction);
    Block block;
    block.tokens = count;
    block.newest = newest;
    block.keys = quant::zip_compress_rows(key_rows.data(), count, D, mask.data(), options_.hi_bits, options_.lo_bits,
                                          options_.group_size, k);
    if (options_.quantize_values) {
      block.values = quant::quantize_row_set(value_rows.data(), count, D, options_.values_at(), options_.group_size, k);
    } else {
      block.raw_values.assign(head.stage_values.begin(), head.stage_values.begin() + static_cast<std::ptrdiff_t>(count * D));
    }
    head.blocks.push_back(std::move(block));

    // Drop the compressed tokens from the window; give back memory a long prompt left behind.
    const auto drop = static_cast<std::ptrdiff_t>(count * D);
    head.stage_keys.erase(head.stage_keys.begin(), head.stage_keys.begin() + drop);
    head.stage_values.erase(head.stage_values.begin(), head.stage_values.begin() + drop);
    if (options_.attention_saliency) {
      head.attention_sum.erase(head.attention_sum.begin(), head.attention_sum.begin() + static_cast<std::ptrdiff_t>(count));
      head.attention_queries.erase(head.attention_queries.begin(),
                                   head.attention_queries.begin() + static_cast<std::ptrdiff_t>(count));
    }
    // The window's memory is counted as resident: keep only what still waits (it regrows
    // geometrically as tokens arrive, so this reallocates once per compressed block).
    head.stage_keys.shrink_to_fit();
    head.stage_values.shrink_to_fit();
    head.attention_sum.shrink_to_fit();
    head.attention_queries.shrink_to_fit();
  }
  staged_ -= count;
}

CacheView ZipCacheCache::decode_view() const {
  const std::size_t N = kept_tokens();
  if (N == 0 || heads_.empty()) return CacheView{};
  const std::size_t D = intake_.head_dim(), n_heads = heads_.size();
  ViewScratch& sc = scratch_;
  sc.keys.resize(n_heads * N * D);
  sc.values.resize(n_heads * N * D);
  sc.positions.resize(n_heads * N);
  const auto& k = quant::simd_kernels();
  std::vector<std::uint16_t*> rows;
  for (std::size_t bh = 0; bh < n_heads; ++bh) {
    const Head& head = heads_[bh];
    std::uint16_t* key_out = sc.keys.data() + bh * N * D;
    std::uint16_t* value_out = sc.values.data() + bh * N * D;
    std::size_t row = 0;
    for (const Block& block : head.blocks) {
      quant::zip_decode_f16(block.keys, key_out + row * D, D, k);
      if (options_.quantize_values) {
        rows.resize(block.tokens);
        for (std::size_t s = 0; s < block.tokens; ++s) rows[s] = value_out + (row + s) * D;
        quant::decode_set_f16(block.values, rows.data(), k);
      } else {
        std::memcpy(value_out + row * D, block.raw_values.data(), block.tokens * D * sizeof(std::uint16_t));
      }
      row += block.tokens;
    }
    if (staged_ != 0) {  // (an empty window may have no buffer at all)
      std::memcpy(key_out + row * D, head.stage_keys.data(), staged_ * D * sizeof(std::uint16_t));
      std::memcpy(value_out + row * D, head.stage_values.data(), staged_ * D * sizeof(std::uint16_t));
    }
    std::copy(positions_.begin(), positions_.end(), sc.positions.begin() + static_cast<std::ptrdiff_t>(bh * N));
  }
  CacheView v;
  v.batch = intake_.batch();
  v.heads = intake_.heads();
  v.tokens = N;
  v.head_dim = D;
  v.head_stride = N;
  v.keys = sc.keys.data();
  v.values = sc.values.data();
  v.positions = sc.positions.data();
  return v;
}

CacheView ZipCacheCache::materialize() const { return decode_view(); }

void ZipCacheCache::observe_attention(const AttentionObservation& obs) {
  if (!options_.attention_saliency || staged_ == 0) return;
  const std::string& m = options_.method;
  const std::size_t N = kept_tokens();
  if (obs.probs == nullptr || obs.batch != intake_.batch() || obs.heads != intake_.heads() || obs.tokens != N ||
      obs.stride < obs.tokens) {
    throw InputError(m + " cache: attention observation [batch=" + std::to_string(obs.batch) + ", heads=" +
                     std::to_string(obs.heads) + ", tokens=" + std::to_string(obs.tokens) + ", stride=" +
                     std::to_string(obs.stride) + "] does not match the last view [batch=" +
                     std::to_string(intake_.batch()) + ", heads=" + std::to_string(intake_.heads()) +
                     ", tokens=" + std::to_string(N) + "]");
  }
  if (!obs.query_positions.empty() && obs.query_positions.size() != obs.queries) {
    throw InputError(m + " cache: attention observation has " + std::to_string(obs.query_positions.size()) +
                     " query positions for " + std::to_string(obs.queries) + " queries");
  }
  check_observation_finite(obs, m + " cache");  // after the shape checks: it reads every weight
  const std::size_t first = N - staged_;  // the window is the tail of the view
  // How many queries could see each staged token (causal: query position >= token position).
  std::vector<float> visible(staged_, static_cast<float>(obs.queries));
  if (!obs.query_positions.empty()) {
    for (std::size_t j = 0; j < staged_; ++j) {
      const std::int64_t p = positions_[first + j];
      visible[j] = static_cast<float>(
          std::count_if(obs.query_positions.begin(), obs.query_positions.end(), [p](std::int64_t q) { return q >= p; }));
    }
  }
  for (std::size_t bh = 0; bh < heads_.size(); ++bh) {
    Head& head = heads_[bh];
    for (std::size_t q = 0; q < obs.queries; ++q) {
      const float* row = obs.probs + (bh * obs.queries + q) * obs.stride + first;
      for (std::size_t j = 0; j < staged_; ++j) head.attention_sum[j] += row[j];
    }
    for (std::size_t j = 0; j < staged_; ++j) head.attention_queries[j] += visible[j];
  }
  // The staged tokens are scored now: compress what is ready instead of holding it in fp16 until
  // the next update (a prompt would otherwise stay uncompressed between prefill and first decode).
  compress_ready();
}

CacheStats ZipCacheCache::stats() const {
  CacheStats st;
  st.method = options_.method;
  st.batch = intake_.batch();
  st.heads = intake_.heads();
  st.head_dim = intake_.head_dim();
  st.tokens_seen = intake_.tokens_seen();
  const std::size_t N = kept_tokens(), D = st.head_dim, n_heads = heads_.size();
  st.kept_per_head.assign(n_heads, N);
  st.tokens_kept = N;
  std::size_t key_bytes = 0, value_bytes = 0, other = 0;
  for (const Head& head : heads_) {
    for (const Block& b : head.blocks) {
      key_bytes += b.keys.resident_bytes();
      value_bytes += b.values.resident_bytes() + b.raw_values.capacity() * sizeof(std::uint16_t);
    }
    other += head.blocks.capacity() * sizeof(Block);
    key_bytes += head.stage_keys.capacity() * sizeof(std::uint16_t);
    value_bytes += head.stage_values.capacity() * sizeof(std::uint16_t);
    other += (head.attention_sum.capacity() + head.attention_queries.capacity()) * sizeof(float);
  }
  other += heads_.capacity() * sizeof(Head) + positions_.capacity() * sizeof(std::int64_t);
  st.resident_bytes = key_bytes + value_bytes + other;
  // Scratch: the shared fp16 view and the intake's fp16 copy of the largest non-fp16 block.
  st.view_bytes = scratch_.bytes() + 2 * max_block_elements_ * sizeof(std::uint16_t);
  const std::size_t kept_fp16_per_tensor = n_heads * N * D * 2;
  st.kept_fp16_bytes = 2 * kept_fp16_per_tensor;
  st.seen_fp16_bytes = static_cast<std::size_t>(st.tokens_seen) * n_heads * D * 2 * 2;
  st.accounted_bytes = accounted_key_bytes_ + accounted_value_bytes_;
  st.compression_ratio = st.resident_bytes == 0 ? 1.0 : static_cast<double>(st.seen_fp16_bytes) / st.resident_bytes;

  const bool any = accounted_key_bytes_ > 0;
  auto& f = st.figures;
  // The original's figures: keys only, from its per-call accounting.
  f.emplace_back("effective_avg_bits", any ? 16.0 * accounted_key_bytes_ / fp16_key_bytes_ : options_.hi_bits);
  f.emplace_back("compression_ratio_keys", any ? fp16_key_bytes_ / accounted_key_bytes_ : 1.0);
  // kvslim's: what is resident, keys + values (and positions, block lists), per kept element.
  f.emplace_back("effective_avg_bits_kv",
                 kept_fp16_per_tensor == 0 ? 0.0 : 16.0 * static_cast<double>(st.resident_bytes) / (2.0 * kept_fp16_per_tensor));
  f.emplace_back("effective_avg_bits_keys_resident",
                 kept_fp16_per_tensor == 0 ? 0.0 : 16.0 * static_cast<double>(key_bytes) / kept_fp16_per_tensor);
  f.emplace_back("resident_key_bytes", static_cast<double>(key_bytes));
  f.emplace_back("resident_value_bytes", static_cast<double>(value_bytes));
  f.emplace_back("accounted_key_bytes", accounted_key_bytes_);
  f.emplace_back("accounted_value_bytes", accounted_value_bytes_);
  f.emplace_back("baseline_key_bytes", baseline_key_bytes_);
  f.emplace_back("fp16_key_bytes", fp16_key_bytes_);
  f.emplace_back("hi_fraction", options_.hi_fraction);
  f.emplace_back("hi_bits", options_.hi_bits);
  f.emplace_back("lo_bits", options_.lo_bits);
  f.emplace_back("value_bits", options_.quantize_values ? options_.values_at() : 16);
  f.emplace_back("staging_tokens", static_cast<double>(staged_));
  f.emplace_back("compressed_blocks", heads_.empty() ? 0.0 : static_cast<double>(heads_[0].blocks.size()));
  return st;
}

std::unique_ptr<KVCache> make_zipcache_cache(const KVCacheConfig& c) {
  ZipCacheOptions o;
  o.method = "zipcache";
  o.hi_bits = c.zipcache_hi_bits;
  o.lo_bits = c.zipcache_lo_bits;
  o.hi_fraction = c.zipcache_hi_fraction;
  o.group_size = static_cast<std::size_t>(std::max(c.zipcache_group_size, 0));
  o.quantize_values = c.zipcache_quantize_values;
  o.value_bits = c.zipcache_value_bits == -1 ? 0 : c.zipcache_value_bits;
  if (c.zipcache_staging < 0) throw ConfigError("KVCacheConfig.zipcache_staging must be >= 0");
  o.staging = static_cast<std::size_t>(c.zipcache_staging);
  if (c.zipcache_saliency == "attention_normalized") {
    o.attention_saliency = true;
  } else if (c.zipcache_saliency != "key_norm") {
    throw ConfigError("KVCacheConfig.zipcache_saliency = \"" + c.zipcache_saliency +
                      "\": expected \"key_norm\" or \"attention_normalized\"");
  }
  return std::make_unique<ZipCacheCache>(o);
}

std::unique_ptr<KVCache> make_kivi_cache(const KVCacheConfig& c) {
  ZipCacheOptions o;
  o.method = "kivi";
  o.hi_bits = o.lo_bits = c.kivi_keys_at();
  o.value_bits = c.kivi_values_at();
  o.hi_fraction = 0.0;
  o.group_size = static_cast<std::size_t>(std::max(c.kivi_group_size, 0));
  o.quantize_values = true;
  if (c.kivi_staging < 0) throw ConfigError("KVCacheConfig.kivi_staging must be >= 0");
  o.staging = static_cast<std::size_t>(c.kivi_staging);
  return std::make_unique<ZipCacheCache>(o);
}

}  // namespace kvslim
