// zipcache (ZipCache-adapted, per-token mixed precision) and kivi (uniform group quantization:
// the same machinery with hi_fraction 0) caches whose resident state IS the compressed form:
// bit-packed codes, fp16 group parameters and the saliency mask, plus a small fp16 staging window.
//
// Per (batch, head): a list of compressed blocks, then the staging window (newest tokens, fp16).
// - staging W > 0 (default): incoming tokens join the window; once it holds >= W tokens, all of its
//   complete groups (floor(staged / gs) * gs oldest tokens) are compressed as ONE block (saliency
//   within that block), the remainder (< gs tokens) keeps waiting. So a long prompt becomes one
//   block, as in the original, and decode tokens are compressed W at a time instead of one by one
//   (the original charges 577 bytes per decode head-token against 256 for fp16).
// - staging 0: every call is compressed alone as one block, the documented behaviour.
// - saliency "attention_normalized": staged tokens collect the attention they receive (divided by
//   the number of queries that could see them); the window is compressed as soon as that step's
//   attention has been observed (so a prompt is compressed right after its prefill, never held
//   in fp16 until the next call), ranking by that score instead of key norm. Without an
//   observation it is compressed at the start of the next update, by the scores it has.
// attend reads the packed codes directly (attend/head_attention.h) and the staging window as fp16.
// materialize() decodes into this layer's own scratch, only when asked (nothing decoded is kept on
// the decode path: that would undo the saving).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/block_intake.h"
#include "cache/view_scratch.h"
#include "kvslim/cache.h"
#include "kvslim/config.h"
#include "kvslim/zipcache.h"

namespace kvslim {

struct ZipCacheOptions {
  std::string method = "zipcache";  // "zipcache" or "kivi" (stats and accounting differ)
  int hi_bits = 4, lo_bits = 2;
  double hi_fraction = 0.2;
  std::size_t group_size = 32;
  bool quantize_values = true;  // values at uniform value_bits (hi_bits unless set); false: kept as fp16
  int value_bits = 0;           // 0: hi_bits (zipcache, kivi at kivi_bits); kivi: kivi_value_bits
  int values_at() const { return value_bits == 0 ? hi_bits : value_bits; }
  std::size_t staging = 128;    // 0: compress every call alone
  bool attention_saliency = false;
};

class ZipCacheCache final : public KVCache {
 public:
  struct Block {
    std::size_t tokens = 0;
    ZipCompressed keys;                    // [tokens, D] mixed precision
    GroupQuantized values;                 // [tokens, D] at values_at() (quantize_values)
    std::vector<std::uint16_t> raw_values; // fp16 [tokens, D] (values not quantized)
    std::int64_t newest = 0;               // the largest position of its tokens (causal mask check)
  };
  struct Head {
    std::vector<Block> blocks;
    std::vector<std::uint16_t> stage_keys, stage_values;  // fp16 [staged, D]
    std::vector<float> attention_sum, attention_queries;  // [staged] (attention saliency only)
  };

  explicit ZipCacheCache(ZipCacheOptions options);

  void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions = {}) override;
  // Blocks in order (scores and value sums from the codes), then the staging window as fp16.
  void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
              float* probs = nullptr, const ParallelFor* parallel = nullptr) const override;
  std::size_t rows() const override { return kept_tokens(); }
  CacheView materialize() const override;
  CacheStats stats() const override;
  void reset() override;
  ObservationNeeds needs() const override { return {options_.attention_saliency, false}; }
  void observe_attention(const AttentionObservation& obs) override;
  std::string_view method() const override { return options_.method; }

  // Read-only access for tests and tools: the per-head state, [batch * heads].
  const std::vector<Head>& heads() const { return heads_; }
  const ZipCacheOptions& options() const { return options_; }
  std::size_t staged_tokens() const { return staged_; }

 private:
  void absorb_intake();
  void compress_ready();
  void compress_oldest(std::size_t count);
  CacheView decode_view() const;
  std::size_t kept_tokens() const { return positions_.size(); }

  ZipCacheOptions options_;
  mutable ViewScratch scratch_;  // materialize() only: this layer's fp16 rows, decoded on request
  BlockIntake intake_;
  std::vector<Head> heads_;             // [batch * heads]
  std::vector<std::int64_t> positions_; // [kept] absolute positions, the same for every head
  std::size_t staged_ = 0;              // tokens waiting in every head's staging window
  std::size_t max_block_elements_ = 0;  // largest non-fp16 block taken: the intake's conversion buffer
  // The original system's accumulators (seed-behaviour.md §4.3), summed over calls and heads.
  double accounted_key_bytes_ = 0, accounted_value_bytes_ = 0, baseline_key_bytes_ = 0, fp16_key_bytes_ = 0;
};

std::unique_ptr<KVCache> make_zipcache_cache(const KVCacheConfig& config);
std::unique_ptr<KVCache> make_kivi_cache(const KVCacheConfig& config);

}  // namespace kvslim
