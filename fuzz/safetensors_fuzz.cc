// libFuzzer target: safetensors header parsing from the bytes of a whole file. Malformed input
// must end in ModelFileError, never a crash, a hang or an out-of-bounds read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvslim::engine;
  try {
    const SafetensorsHeader header =
        parse_safetensors_header(std::as_bytes(std::span(data, size)), "fuzz.safetensors");
    // Touch every byte a tensor claims, so ASan sees any out-of-bounds view.
    volatile unsigned char sink = 0;
    for (const TensorInfo& t : header.tensors) {
      const auto* bytes = static_cast<const unsigned char*>(t.data);
      for (std::size_t i = 0; i < t.nbytes; ++i) sink = sink ^ bytes[i];
    }
  } catch (const ModelFileError&) {
  }
  return 0;
}
