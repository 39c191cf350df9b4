#include "storage/fp16_slots.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "attend/head_attention.h"
#include "kvslim/convert.h"

namespace kvslim {

void Fp16Slots::begin(std::size_t heads_total, std::size_t dim) {
  heads_total_ = heads_total;
  dim_ = dim;
}

void Fp16Slots::relayout(std::size_t capacity, std::size_t keep) {
  UninitBuffer<std::uint16_t> keys(heads_total_ * capacity * dim_), values(heads_total_ * capacity * dim_);
  keep = std::min(keep, capacity);
  for (std::size_t head = 0; head < heads_total_ && keep != 0; ++head) {
    const std::size_t src = head * capacity_, dst = head * capacity;
    std::memcpy(keys.data() + dst * dim_, keys_.data() + src * dim_, keep * dim_ * sizeof(std::uint16_t));
    std::memcpy(values.data() + dst * dim_, values_.data() + src * dim_, keep * dim_ * sizeof(std::uint16_t));
  }
  keys_ = std::move(keys);
  values_ = std::move(values);
  capacity_ = capacity;
}

void Fp16Slots::write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) {
  const std::size_t row = head * capacity_ + slot;
  std::memcpy(keys_.data() + row * dim_, key, dim_ * sizeof(std::uint16_t));
  std::memcpy(values_.data() + row * dim_, value, dim_ * sizeof(std::uint16_t));
}

void Fp16Slots::move(std::size_t head, std::size_t from, std::size_t to) {
  const std::size_t src = head * capacity_ + from, dst = head * capacity_ + to;
  std::memcpy(keys_.data() + dst * dim_, keys_.data() + src * dim_, dim_ * sizeof(std::uint16_t));
  std::memcpy(values_.data() + dst * dim_, values_.data() + src * dim_, dim_ * sizeof(std::uint16_t));
}

void Fp16Slots::erase(std::size_t, std::span<const std::size_t>) {
  // The core compacts slot storages by move() (holes filled by the last rows).
  throw std::logic_error("fp16 slot storage: erase is not used (the core moves rows into holes)");
}

void Fp16Slots::key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const {
  dot_fp16_rows(keys_.data() + head * capacity_ * dim_, n, dim_, dim_, query, logits);
}

void Fp16Slots::feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const {
  // The online-softmax kernel reads each kept row once, in slot order.
  ha.fp16_rows(keys_.data() + head * capacity_ * dim_, values_.data() + head * capacity_ * dim_, dim_, pos, n, 0);
}

CacheView Fp16Slots::view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                          std::size_t pos_stride) const {
  (void)pos_stride;  // the same as capacity_: the core's metadata and the slots share the layout
  CacheView v;
  v.batch = batch;
  v.heads = heads;
  v.tokens = rows;
  v.head_dim = dim_;
  v.head_stride = capacity_;
  v.keys = keys_.data();
  v.values = values_.data();
  v.positions = positions;
  return v;
}

void Fp16Slots::reset() {
  heads_total_ = dim_ = capacity_ = 0;
  keys_.release();
  values_.release();
}

std::unique_ptr<RowStorage> make_fp16_storage() { return std::make_unique<Fp16Slots>(); }

}  // namespace kvslim
