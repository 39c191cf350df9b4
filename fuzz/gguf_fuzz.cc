// libFuzzer target: a GGUF file's header, metadata and tensor table, then everything the model
// loader reads from them (config keys, tensor names/types/shapes, q/k un-permutation, the block
// decoders of Q8_0/Q4_0/Q4_K/Q5_K/Q6_K) and the tokenizer rebuilt from tokenizer.ggml.*. Malformed input must end in
// ModelFileError (or kvslim's InputError / invalid_argument from the checks after loading), never
// a crash, a hang or an out-of-bounds read.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "engine/gguf.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/ops.h"
#include "engine/tokenizer.h"
#include "kvslim/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvslim::engine;
  gguf::Header header;
  try {
    header = gguf::parse(std::as_bytes(std::span(data, size)), "fuzz.gguf");
  } catch (const ModelFileError&) {
    return 0;
  }
  // Touch every byte a supported tensor claims, so ASan sees any out-of-bounds view.
  volatile unsigned char sink = 0;
  for (const gguf::TensorEntry& t : header.tensors) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(t.data);
    for (std::size_t i = 0; i < t.nbytes; ++i) sink = sink ^ bytes[i];
  }
  try {
    GgufModel g = read_gguf_model(header, "fuzz.gguf", nullptr);
    // Block-quantized tensors stay as stored: decode the first blocks of each (the kernels'
    // decoders; a hostile scale may give NaN, never a bad read).
    std::vector<float> tmp(4096);
    for (const std::string& name : g.store.names()) {
      const TensorInfo& t = *g.store.find(name);
      const std::size_t n = std::min(weight_elements(t.type, t.nbytes), tmp.size());
      convert_weights(t.data, t.type, tmp.data(), n / weight_block_elements(t.type) * weight_block_elements(t.type));
    }
    // Small models only: the shape checks of Model::from allocate norm vectors of hidden_size.
    if (g.config.hidden_size <= 4096 && g.config.num_layers <= 64) {
      const Model m = Model::from(std::move(g.config), std::move(g.store));
      (void)m;
    }
  } catch (const ModelFileError&) {
  } catch (const std::invalid_argument&) {
  }
  try {
    const Tokenizer t = Tokenizer::from_json_text(gguf_tokenizer_json(header, "fuzz.gguf"), "fuzz.gguf");
    (void)t.encode("Hello, world 123!");
  } catch (const ModelFileError&) {
  } catch (const kvslim::InputError&) {
  }
  return 0;
}
