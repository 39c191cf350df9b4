// Compressed row storage: the kivi kind (uniform group quantization of keys and values, each at its
// own width: key bits = hi_bits = lo_bits, value_bits) and the
// zipcache kind (salient rows' keys at hi_bits, the rest at lo_bits, values at hi_bits), under any
// eviction policy.
//
// Per head: a list of blocks, then a staging window of fp16 rows (the newest). Each block is ONE
// quantization group (at most group_size rows quantized together, per channel: the kivi / zipcache
// grid of quant/group_quant.h). That is what lets a policy drop a row anywhere: removing a row's
// codes leaves the group's scale and zero valid for the rows that stay, so no row is ever
// re-quantized and the others keep their exact codes. (A block of several groups could not lose a
// row without shifting every later row into another group.) Once a head's blocks are under a
// quarter of the rows they were made with (a long generation evicting from old groups), they are re-packed into
// full groups: the only time a row is rounded again (once per re-pack it survives), and what keeps
// the per-group bookkeeping within 4x of the rows held.
//
// Rows wait in the window until the step's eviction is decided (settle): a prompt is appended in
// fp16, attended, scored, evicted, and only its survivors are compressed, all of them (whole groups
// and one short group: a short group's parameters cost far less than its rows in fp16). Rows of
// single-token steps then wait until `staging` rows wait: with staging >= group_size every complete
// group is then compressed (fewer than group_size rows stay fp16); with a smaller staging the
// waiting rows are compressed as one short group (fewer than `staging` stay fp16, at the cost of a
// group's parameters per `staging` rows). Saliency (zipcache kind) is chosen within each group: by key
// norm, or by the policy's row score (attention saliency).
// attend reads the codes directly (attend/head_attention.h): one packed segment per block, then the
// window as fp16.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cache/view_scratch.h"
#include "kvslim/zipcache.h"
#include "storage/row_storage.h"

namespace kvslim {

struct PackedRowsOptions {
  std::string kind = "kivi";  // "kivi" (hi_fraction 0: one precision) or "zipcache"
  int hi_bits = 4, lo_bits = 4;
  double hi_fraction = 0.0;
  std::size_t group_size = 32;
  bool quantize_values = true;       // values at values_at(); false: fp16
  int value_bits = 0;                // 0: hi_bits (zipcache; kivi at kivi_bits); kivi: kivi_value_bits
  int values_at() const { return value_bits == 0 ? hi_bits : value_bits; }
  std::size_t staging = 32;          // decode rows: compress once this many wait (>= group_size: whole groups only)
  bool attention_saliency = false;   // zipcache: salient = the policy's highest row scores
};

class PackedRows final : public RowStorage {
 public:
  // One quantization group of rows.
  struct Block {
    std::size_t tokens = 0;
    std::size_t made = 0;                   // rows when it was compressed (evictions only lower tokens)
    ZipCompressed keys;                     // [tokens, D]: hi and lo sets, one group each
    GroupQuantized values;                  // [tokens, D] at values_at(), one group (quantize_values)
    std::vector<std::uint16_t> raw_values;  // fp16 [tokens, D] (values not quantized)
  };
  struct Head {
    std::vector<Block> blocks;
    std::size_t packed = 0;                               // rows in blocks
    std::size_t made = 0;                                 // sum of the blocks' made
    std::size_t repacks = 0;                              // re-packs so far (each rounds its rows again)
    std::vector<std::uint16_t> stage_keys, stage_values;  // fp16 [staged, D]
  };

  explicit PackedRows(PackedRowsOptions options);

  std::string_view kind() const override { return options_.kind; }
  bool slot_writes() const override { return false; }
  void begin(std::size_t heads_total, std::size_t dim) override;
  void relayout(std::size_t capacity, std::size_t keep) override;
  void prepare(std::size_t incoming) override;
  void write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) override;
  void move(std::size_t head, std::size_t from, std::size_t to) override;
  void erase(std::size_t head, std::span<const std::size_t> slots) override;
  void settle(std::size_t rows, const Saliency& saliency) override;
  void key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const override;
  void feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const override;
  CacheView view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                 std::size_t pos_stride) const override;
  std::size_t resident_bytes() const override;
  std::size_t view_bytes() const override { return scratch_.bytes(); }
  void reset() override;
  void add_figures(CacheStats& stats) const override;

  // Read-only, for tests: the per-head state [heads_total].
  const std::vector<Head>& heads() const { return heads_; }
  const PackedRowsOptions& options() const { return options_; }

 private:
  std::size_t staged(const Head& h) const { return h.stage_keys.size() / dim_; }
  // The head's first `count` staged rows (a multiple of group_size) become blocks of one group.
  void compress(std::size_t head, std::size_t count, const Saliency& saliency);
  // The head's blocks, thinned by evictions, rebuilt as full groups of the same rows.
  void repack(std::size_t head);
  // The head's rows [0, n) decoded to fp16 keys/values at out + r * dim (values may be null).
  void decode_head(std::size_t head, std::size_t n, std::uint16_t* keys, std::uint16_t* values) const;

  PackedRowsOptions options_;
  std::size_t dim_ = 0;
  std::vector<Head> heads_;      // [batch * kv_heads]
  mutable ViewScratch scratch_;  // view() only
  bool flush_ = false;           // a multi-row append came: its survivors are compressed whole
};

// Drops row r of a one-group set / a block of one-group sets, keeping the group parameters (exact
// for every other row). Exposed for tests.
void erase_group_row(GroupQuantized& set, std::size_t r);
void erase_block_row(ZipCompressed& keys, std::size_t r);

}  // namespace kvslim
