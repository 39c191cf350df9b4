// Scratch that holds the fp16 rows a compressed cache decodes for materialize(). Each layer owns
// its own (layers may run on different threads, and one layer's view must not be overwritten by
// another's); it is allocated only when someone asks for rows -- attend never uses it.
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
