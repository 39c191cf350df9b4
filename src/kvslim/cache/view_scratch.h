// Scratch that holds the fp16 view of a compressed cache. One instance is shared by every layer of
// a CacheSet (a view is valid only until the next mutating call on any cache of the set), so a
// model holds its compressed state plus ONE layer's worth of decoded fp16, not a full fp16 copy.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

namespace kvslim {

struct ViewScratch {
  std::vector<std::uint16_t> keys;      // fp16 [batch * heads, rows, head_dim]
  std::vector<std::uint16_t> values;    // fp16 [batch * heads, rows, head_dim]
  std::vector<std::int64_t> positions;  // [batch * heads, rows]
  std::size_t bytes() const {
    return (keys.capacity() + values.capacity()) * sizeof(std::uint16_t) +
           positions.capacity() * sizeof(std::int64_t);
  }
};

}  // namespace kvslim
