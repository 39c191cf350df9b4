// A KVCache over the eviction core: full, streaming, h2o and pyramidkv are this class with
// different policies; squeeze derives from it and adds only its re-budget. Any of them runs over
// any row storage (KVCacheConfig::storage: fp16 slots, kivi codes, zipcache mixed precision).
#pragma once
#include <string>

#include "block_intake.h"
#include "eviction_core.h"
#include "kvslim/cache.h"

namespace kvslim {

// What an eviction core asks its caller to observe (KVCache::needs): the attention when scored by
// it, only a prefill's last obs_window queries when the policy has a window.
ObservationNeeds eviction_needs(const EvictionCore& core);

class EvictionCache : public KVCache, public SharesImportance {
 public:
  // `storage` null: fp16 slots.
  EvictionCache(std::string method, EvictionPolicy policy, std::size_t budget, std::unique_ptr<RowStorage> storage = nullptr);

  void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions = {}) override;
  // The storage feeds its rows to the online-softmax kernels in slot order (codes read as codes).
  void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
              float* probs = nullptr, const ParallelFor* parallel = nullptr) const override;
  std::size_t rows() const override { return core_.rows(); }
  // fp16 slots: the slots themselves, no copy; a compressed storage decodes into its scratch.
  CacheView materialize() const override { return core_.view(); }
  CacheStats stats() const override;
  void reset() override;
  void reserve(std::size_t tokens) override { core_.reserve(tokens); }
  ObservationNeeds needs() const override;
  void observe_attention(const AttentionObservation& obs) override;
  std::string_view method() const override { return method_; }

  std::size_t budget() const { return budget_; }
  // The model's cross-layer board (KVCacheBuilder): this cache is sharing layer number `layer`.
  void share_importance(std::shared_ptr<CrossLayerImportance> board, std::size_t layer) override {
    core_.share_importance(std::move(board), layer);
  }
  const EvictionCore& core() const { return core_; }
  // kvslim/prior_scores.h: the next prefill observation also ranks rows by `prior`.
  void attach_prior(std::shared_ptr<const PriorScores> prior) { core_.attach_prior(std::move(prior)); }

 protected:
  // The row limit eviction enforces now (squeeze may defer to a larger one until it knows its budget).
  virtual std::size_t eviction_limit() const { return budget_; }
  // Called with the validated block before it is absorbed, and after each step's eviction.
  virtual void before_absorb(const BlockIntake&) {}
  virtual void after_step() {}
  virtual void add_figures(CacheStats&) const {}
  // Adopts a new budget and trims every head to it now.
  void rebudget(std::size_t budget);
  // Tells the core whether the storage should wait before compressing (see hold_compression_above).
  void hold_while_uncertain();
  bool attention_scored() const;

  BlockIntake intake_;
  EvictionCore core_;
  std::size_t budget_;

 private:
  std::string method_;
};

}  // namespace kvslim
