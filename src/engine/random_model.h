// Writes a small random Llama-family model directory (config.json + model.safetensors) so tests,
// benchmarks and the CLI can exercise the engine without shipping weights.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace kvslim::engine {

struct RandomModelSpec {
  std::string architecture = "llama";  // model_type: "llama", "qwen2", "mistral"
  int hidden_size = 64, intermediate_size = 160, num_layers = 2, num_heads = 4, num_kv_heads = 2,
      head_dim = 16, vocab_size = 97, max_position_embeddings = 4096;
  WeightType dtype = WeightType::f32;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (Qwen2 always has them)
  double rope_theta = 10000, rms_norm_eps = 1e-5;
  RopeScaling rope_scaling;     // type "none", "linear" or "llama3"
  std::uint64_t seed = 1;
  // Also write a byte-level tokenizer.json: ids 0..255 are the bytes (GPT-2 byte characters),
  // 256 is "<s>" (BOS, added by the post-processor) and 257 "</s>" (EOS); needs vocab_size >= 258.
  bool byte_tokenizer = false;
};

// Creates `dir` if needed and writes the files. Weights are uniform in +-1/sqrt(fan_in) (norm
// weights around 1), so activations stay O(1) through the layers. The files are streamed (one
// tensor in memory at a time) into a temporary directory beside `dir` and moved into place once
// complete, so a failure leaves `dir` as it was. A non-empty `dir` is refused unless `force`; with
// `force` its model files (*.safetensors, the index, config/tokenizer JSON) are replaced, so it
// never holds a mix of two models.
void write_random_model(const std::filesystem::path& dir, const RandomModelSpec& spec, bool force = false);

}  // namespace kvslim::engine
