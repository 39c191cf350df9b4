// zipcache on the device: per-token mixed precision resident in GPU memory, attended where it lies.
//
// As the CPU cache (cache/zipcache_cache.h): every call's rows join an fp16 window; once it holds
// `staging` rows its complete groups (the oldest floor(staged / group) * group rows) become one
// block, whose salient rows (the hi_fraction of largest key norm, per head) keep their keys at
// hi_bits and the others at lo_bits, each set group-quantized over its own consecutive rows. What
// differs (zip_flush.h): each set's values are grouped over that set's rows, not in token order,
// so a 32-row unit of keys is paired with the same rows' values; and a block's set ends in a
// part-filled unit (empty slots masked by position). Each head's sets are two kivi-like segments of
// the codes kernel (per-head positions: saliency differs per head), then the window's fp16 rows.
//
// Not here (named errors): attention probabilities (a salient set holds a head's rows out of token
// order; saliency by attention needs them), every call compressed alone (staging 0). Decode steps
// replay as a CUDA graph (StepGraph): a block's three kernels are nodes switched on in the step
// whose window is full.
#pragma once
#include <cstdint>
#include <vector>

#include "cuda/device_cache.h"
#include "cuda/zip_flush.h"

namespace kvslim::cuda {

class DeviceZipCache final : public DeviceCache {
 public:
  DeviceZipCache(int device, int hi_bits, int lo_bits, int value_bits, double hi_fraction, int group_rows, int staging);

  // Host copies of the stored state, for tests. Per head: each set's codes [units * 32 * row_bytes],
  // parameters [units, 2, D] (fp16 scale row, zero row per unit) and positions [units * 32]; the
  // saliency bits of the compressed tokens; the window's rows fp16 [staged * D].
  struct SetSnapshot {
    int units = 0, k_row_bytes = 0, v_row_bytes = 0;
    std::vector<std::vector<std::uint8_t>> k_codes, v_codes;
    std::vector<std::vector<std::uint16_t>> k_params, v_params;
    std::vector<std::vector<std::int64_t>> pos;
    std::vector<std::uint8_t> unit_starts;  // [units]: 1 where a parameter group begins
  };
  struct Block {
    long long first_token = 0;  // the block's first token in the cache's order (a multiple of 32)
    int tokens = 0, n_hi = 0;
    int hi_unit0 = 0, lo_unit0 = 0;  // its first unit in each set
  };
  struct Snapshot {
    SetSnapshot hi, lo;
    std::vector<Block> blocks;
    std::vector<std::vector<std::uint32_t>> mask;  // [BH][words]: bit t = token t is salient
    int staged = 0;
    std::vector<std::vector<std::uint16_t>> stage_k, stage_v;
  };
  Snapshot snapshot() const;
  // The sets, saliency bits and scratch for `tokens` in all (the blocks decode steps make), so that
  // a captured step allocates nothing.
  void reserve(std::size_t tokens) override;
  bool graph_replayable() const override { return true; }

 private:
  struct SetStore {
    int k_bits = 4, v_bits = 4;
    DeviceBuffer k_codes, v_codes, k_params, v_params, pos;
    DeviceBuffer unit_starts;  // [unit_capacity] bytes: 1 where a group begins (ZipSet::unit_starts)
    std::size_t unit_capacity = 0;
    int units = 0;
    std::size_t bytes() const {
      return k_codes.bytes() + v_codes.bytes() + k_params.bytes() + v_params.bytes() + pos.bytes() + unit_starts.bytes();
    }
  };

  bool gives_probabilities() const override { return false; }
  void absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const override;
  void download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const override;
  std::size_t device_bytes() const override;
  std::size_t host_bytes() const override;
  void clear() override;
  void add_figures(CacheStats& st) const override;

  // The window holds at least `rows` rows per head, its staged rows kept (capacity a multiple of 32).
  void resize_window(std::size_t rows, cudaStream_t stream);
  void grow_set(SetStore& s, std::size_t units, cudaStream_t stream);
  void grow_mask(std::size_t words, cudaStream_t stream);
  // Refuses growth inside a captured step (named, with what to reserve).
  void check_not_capturing(const std::string& what) const;
  int parts_at_capacity(const QueryArgs& q) const override;
  // The window's m oldest rows become one block (zip_flush.h); the rest move to its front.
  void flush(int m, cudaStream_t stream);
  PackedRows packed(const SetStore& s) const;
  ZipSet zip_set(SetStore& s) const;
  // Heads [first, first + count) only (download_rows reads one head).
  Snapshot snapshot_heads(std::size_t first, std::size_t count) const;
  SetSnapshot set_snapshot(const SetStore& s, std::size_t first, std::size_t count) const;

  int value_bits_, group_rows_, staging_;
  double hi_fraction_;
  SetStore hi_, lo_;
  DeviceBuffer win_k_, win_v_, win_pos_;  // fp16 [BH, window_capacity_, D], positions [window_capacity_]
  std::size_t window_capacity_ = 0;
  int staged_ = 0;
  DeviceBuffer mask_;  // [BH, mask_words_] saliency bits of the compressed tokens
  std::size_t mask_words_ = 0;
  DeviceBuffer norms_, salient_, members_;  // the flush's scratch, [BH, m] each
  std::vector<Block> blocks_;
  long long compressed_ = 0;  // tokens in blocks
};

}  // namespace kvslim::cuda
