// fp16 slot storage: keys and values as fp16 rows in per-head slots, written and moved one row at a
// time. The eviction core's original representation, unchanged (same allocation, same kernels).
#pragma once
#include "storage/row_storage.h"
#include "uninit_buffer.h"

namespace kvslim {

class Fp16Slots final : public RowStorage {
 public:
  std::string_view kind() const override { return "fp16"; }
  bool slot_writes() const override { return true; }
  void begin(std::size_t heads_total, std::size_t dim) override;
  void relayout(std::size_t capacity, std::size_t keep) override;
  void write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) override;
  void move(std::size_t head, std::size_t from, std::size_t to) override;
  void erase(std::size_t head, std::span<const std::size_t> slots) override;
  void key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const override;
  const std::uint16_t* fp16_key(std::size_t head, std::size_t slot) const override {
    return keys_.data() + (head * capacity_ + slot) * dim_;
  }
  void feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const override;
  CacheView view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                 std::size_t pos_stride) const override;
  std::size_t resident_bytes() const override { return keys_.bytes() + values_.bytes(); }
  void reset() override;

 private:
  std::size_t heads_total_ = 0, dim_ = 0;
  std::size_t capacity_ = 0;            // rows per head allocated (the core's capacity)
  UninitBuffer<std::uint16_t> keys_;    // fp16 [heads_total, capacity, dim]
  UninitBuffer<std::uint16_t> values_;  // fp16 [heads_total, capacity, dim]
};

}  // namespace kvslim
