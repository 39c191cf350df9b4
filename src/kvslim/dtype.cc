#include <string>

#include "kvslim/block.h"
#include "kvslim/dtype.h"

namespace kvslim {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
  }
  return "?";
}

std::string_view memory_space_name(MemorySpace space) { return space == MemorySpace::cuda ? "cuda" : "host"; }

std::string KVBlock::shape_string() const {
  return "[" + std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(tokens) + ", " +
         std::to_string(head_dim) + "] " + std::string(dtype_name(dtype));
}

}  // namespace kvslim
