#include "block_intake.h"

#include <algorithm>
#include <limits>
#include <string>

#include "kernels.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"

namespace kvslim {
namespace {

[[noreturn]] void reject(std::string_view method, const std::string& what) {
  throw InputError(std::string(method) + " cache: " + what);
}

// First (b, h, s) row holding a non-finite fp16 value, or -1.
long first_nonfinite_row(const std::uint16_t* x, std::size_t n, std::size_t dim) {
  if (!kernels::fp16_has_nonfinite(x, n)) return -1;
  for (std::size_t r = 0; r * dim < n; ++r) {
    if (kernels::fp16_has_nonfinite(x + r * dim, dim)) return static_cast<long>(r);
  }
  return -1;
}

// The fp16 form of a block: the block itself when it is fp16, else converted into `buffer`.
const std::uint16_t* as_fp16(const KVBlock& block, std::vector<std::uint16_t>& buffer) {
  if (block.dtype == DType::f16) return static_cast<const std::uint16_t*>(block.data);
  buffer.resize(block.elements());
  convert_to_fp16(block.data, block.dtype, buffer.data(), buffer.size());
  return buffer.data();
}

}  // namespace

std::vector<std::int64_t> check_append(std::string_view method_, MemorySpace space, const KVBlock& keys,
                                       const KVBlock& values, std::span<const std::int64_t> positions,
                                       std::size_t batch_, std::size_t heads_, std::size_t dim_,
                                       std::int64_t next_position_) {
  if (keys.space != space || values.space != space) {
    reject(method_, "keys are in " + std::string(memory_space_name(keys.space)) + " memory and values in " +
                        std::string(memory_space_name(values.space)) + "; this cache takes " +
                        std::string(memory_space_name(space)) + " blocks (KVCacheConfig.device chooses)");
  }
  if (keys.data == nullptr || values.data == nullptr) reject(method_, "keys or values has no data pointer");
  if (keys.batch != values.batch || keys.heads != values.heads || keys.tokens != values.tokens ||
      keys.head_dim != values.head_dim) {
    reject(method_, "keys " + keys.shape_string() + " and values " + values.shape_string() + " differ in shape");
  }
  if (keys.batch == 0 || keys.heads == 0 || keys.tokens == 0 || keys.head_dim == 0) {
    reject(method_, "keys " + keys.shape_string() + ": every dimension of [batch, heads, tokens, head_dim] must be >= 1");
  }
  if (batch_ != 0 && (keys.batch != batch_ || keys.heads != heads_ || keys.head_dim != dim_)) {
    reject(method_, "keys " + keys.shape_string() + ": this cache holds [batch=" + std::to_string(batch_) +
                        ", heads=" + std::to_string(heads_) + ", head_dim=" + std::to_string(dim_) +
                        "]; batch, heads and head_dim cannot change (reset() first)");
  }
  const std::size_t S = keys.tokens;
  if (!positions.empty() && positions.size() != S) {
    reject(method_, "positions has " + std::to_string(positions.size()) + " entries for " + std::to_string(S) + " tokens");
  }
  // Every position leaves room for a next one, so nothing below (lower bounds, next_position_)
  // wraps past INT64_MAX.
  constexpr std::int64_t kMaxPosition = std::numeric_limits<std::int64_t>::max();
  const bool past_max = positions.empty() ? next_position_ > kMaxPosition - static_cast<std::int64_t>(S)
                                          : std::find(positions.begin(), positions.end(), kMaxPosition) != positions.end();
  if (past_max) {
    reject(method_, "positions would reach INT64_MAX (next position " + std::to_string(next_position_) + ", " +
                        std::to_string(S) + " tokens); no position may follow it");
  }
  for (std::size_t s = 0; s < positions.size(); ++s) {
    const std::int64_t lower = s == 0 ? next_position_ : positions[s - 1] + 1;
    if (positions[s] < lower) {
      reject(method_, "positions[" + std::to_string(s) + "] = " + std::to_string(positions[s]) +
                          ": positions must increase and follow the last one seen (expected >= " + std::to_string(lower) + ")");
    }
  }
  std::vector<std::int64_t> resolved(S);
  for (std::size_t s = 0; s < S; ++s) {
    resolved[s] = positions.empty() ? next_position_ + static_cast<std::int64_t>(s) : positions[s];
  }
  return resolved;
}

void BlockIntake::take(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) {
  std::vector<std::int64_t> resolved =
      check_append(method_, MemorySpace::host, keys, values, positions, batch_, heads_, dim_, next_position_);
  const std::size_t S = keys.tokens;
  const std::size_t n = keys.elements();
  const std::uint16_t* k16 = as_fp16(keys, keys16_);
  const std::uint16_t* v16 = as_fp16(values, values16_);
  for (auto [name, buf] : {std::pair<const char*, const std::uint16_t*>{"keys", k16}, {"values", v16}}) {
    const long r = first_nonfinite_row(buf, n, keys.head_dim);
    if (r >= 0) {
      const std::size_t s = r % S, bh = r / S;
      reject(method_, std::string(name) + "[" + std::to_string(bh / keys.heads) + ", " + std::to_string(bh % keys.heads) +
                          ", " + std::to_string(s) + ", :] is NaN or infinite (fp16 holds |x| <= 65504)");
    }
  }
  // Everything checked: commit.
  keys_ = k16;
  values_ = v16;
  batch_ = keys.batch;
  heads_ = keys.heads;
  dim_ = keys.head_dim;
  tokens_ = S;
  positions_ = std::move(resolved);
  next_position_ = positions_[S - 1] + 1;
  tokens_seen_ += S;
}

void BlockIntake::reset() {
  batch_ = heads_ = dim_ = tokens_ = 0;
  tokens_seen_ = 0;
  next_position_ = 0;
}

}  // namespace kvslim
