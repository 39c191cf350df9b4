// The storage-independent part of KVCache::attend: argument checks, the split into (batch, KV head)
// tasks, and per task an online softmax (flash-decoding style) over the segments a cache feeds it in
// its row order: runs of fp16 rows (slots, staging windows) and group-quantized blocks. Each
// segment's scores are computed from the storage, the running max/sum/accumulators are rescaled,
// and the segment's values are added; nothing is materialised.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "kvslim/cache.h"
#include "kvslim/zipcache.h"

namespace kvslim::attend {

class HeadAttention {
 public:
  // Queries of KV head g of batch b: the query heads g*group .. g*group+group-1 of every token.
  // Vector m = s * group + j. `rows_total` is the cache's rows() (the probs columns, when kept).
  void begin(const QueryBlock& queries, std::span<const std::int64_t> query_positions, std::size_t b,
             std::size_t g, std::size_t group, std::size_t rows_total, bool keep_probs);

  // n fp16 rows (keys/values row r at + r * stride elements, positions pos[r]), the cache's rows
  // first .. first + n - 1.
  void fp16_rows(const std::uint16_t* keys, const std::uint16_t* values, std::size_t stride,
                 const std::int64_t* pos, std::size_t n, std::size_t first);
  // A compressed block of n tokens: keys at mixed precision (ZipCompressed; kivi's has one set),
  // values group-quantized in token order, or fp16 rows [n, D] when raw_values is set; `newest` is
  // the largest of its positions.
  void packed_block(const ZipCompressed& keys, const GroupQuantized* values, const std::uint16_t* raw_values,
                    const std::int64_t* pos, std::int64_t newest, std::size_t n, std::size_t first);

  // out rows of this task: vector m -> out[((b * S + s) * H + g * group + j) * D]; probs (when kept)
  // -> [b, g, s, rows_total] summed over j.
  void finish(float* out, float* probs);

 private:
  // Masks the segment's scores [M, n] (ld; newest = the largest of pos), updates the running max and sum, rescales the
  // accumulators; leaves the probabilities (unnormalised, relative to the new max) in place.
  void softmax_step(float* scores, std::size_t ld, const std::int64_t* pos, std::int64_t newest, std::size_t n,
                    std::size_t first);
  // A block's scores [M, n] into scores_ by the fp32 kernels (CPUs without the integer ones).
  void packed_logits_fp32(const ZipCompressed& keys, std::size_t n);
  void grouped_values(const GroupQuantized& set, const float* p, std::size_t ld);

  std::size_t M_ = 0, D_ = 0, S_ = 0, H_ = 0, group_ = 0, b_ = 0, g_ = 0, rows_total_ = 0;
  bool keep_probs_ = false;
  std::int64_t min_qpos_ = 0;
  std::vector<float> q_;               // [M, D] queries times the logit scale
  std::vector<std::int64_t> qpos_;     // [M]
  std::vector<float> max_, sum_;       // [M] running max and sum of exponentials
  std::vector<float> acc_;             // [M, D] running weighted value sum
  std::vector<float> scores_;          // [M, segment] scores, then probabilities
  std::vector<float> set_scores_;      // [M, n_hi] then [M, n_lo]: a mixed block's scores by set
  std::vector<float> kept_;            // [M, rows_total] masked scores (probs only)
  std::vector<float> qs_, bias_, gacc_, gsum_;  // per quantization group: q * scale [M, D], q . zero [M], [M, D], [M]
  std::vector<float> scale_, zero_;    // [D] group parameters as fp32
  std::vector<std::uint8_t> codes_;    // [group_size, D] unpacked codes of one group
  std::vector<std::uint32_t> index_;   // [block tokens] token of each row of a mixed block: hi rows, then lo
};

// Checks the arguments of KVCache::attend against a cache of `batch` x `kv_heads` heads of
// `head_dim` (throws InputError naming the mismatch; batch 0 = nothing appended yet), then runs
// `task(head, b, g)` for every (b, g) with a thread-local HeadAttention begun for it, and finishes
// it into out/probs. Before the first append (batch 0) out is zero-filled.
void run(std::string_view method, std::size_t batch, std::size_t kv_heads, std::size_t head_dim,
         std::size_t rows, const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
         float* probs, const ParallelFor* parallel,
         const std::function<void(HeadAttention&, std::size_t b, std::size_t g)>& task);

}  // namespace kvslim::attend
