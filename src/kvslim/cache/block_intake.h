// Validation and fp16 conversion of the blocks a cache receives, shared by every method.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvslim/block.h"

namespace kvslim {

// The checks every cache makes of an append, host or device (data never read here): both blocks
// in `space`, the same shape, every dimension >= 1, batch/heads/head_dim as established (batch 0:
// not yet), positions S increasing values after next_position (or none). Returns the block's
// positions. Throws InputError naming what is wrong.
std::vector<std::int64_t> check_append(std::string_view method, MemorySpace space, const KVBlock& keys,
                                       const KVBlock& values, std::span<const std::int64_t> positions,
                                       std::size_t batch, std::size_t heads, std::size_t dim,
                                       std::int64_t next_position);

// Checks each (keys, values) pair against the shape the cache established on its first call,
// rejects NaN/Inf, resolves positions, and converts to fp16 into buffers reused across calls.
class BlockIntake {
 public:
  explicit BlockIntake(std::string method) : method_(std::move(method)) {}

  // Throws InputError naming the tensor and what was expected; on error nothing is changed.
  void take(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions);
  void reset();

  bool established() const { return batch_ != 0; }
  std::size_t batch() const { return batch_; }
  std::size_t heads() const { return heads_; }
  std::size_t head_dim() const { return dim_; }
  std::size_t tokens() const { return tokens_; }  // of the last take()
  std::uint64_t tokens_seen() const { return tokens_seen_; }

  // fp16 [batch * heads, tokens, head_dim]: the caller's own data when it came as fp16 (valid for
  // the duration of the update), else the converted copy.
  const std::uint16_t* keys() const { return keys_; }
  const std::uint16_t* values() const { return values_; }
  const std::int64_t* positions() const { return positions_.data(); }  // [tokens]
  const std::uint16_t* key_row(std::size_t head, std::size_t s) const { return keys_ + (head * tokens_ + s) * dim_; }
  const std::uint16_t* value_row(std::size_t head, std::size_t s) const { return values_ + (head * tokens_ + s) * dim_; }

 private:
  std::string method_;
  std::size_t batch_ = 0, heads_ = 0, dim_ = 0, tokens_ = 0;
  std::uint64_t tokens_seen_ = 0;
  std::int64_t next_position_ = 0;
  std::vector<std::uint16_t> keys16_, values16_;  // conversion buffers, reused across calls
  const std::uint16_t* keys_ = nullptr;
  const std::uint16_t* values_ = nullptr;
  std::vector<std::int64_t> positions_;
};

}  // namespace kvslim
