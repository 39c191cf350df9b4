// Hyper-parameters of a Llama-family model from HF config.json (+ generation_config.json).
// Accepts both the transformers <5 field names (rope_theta, rope_scaling, torch_dtype) and the
// transformers 5 ones (rope_parameters{rope_theta, rope_type, factor, ...}, dtype).
#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model_file_error.h"

namespace kvslim::engine {

struct RopeScaling {
  std::string type = "none";  // "none", "linear", "llama3" or "freq_factors"
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int original_max_position_embeddings = 0;
  // "freq_factors" (a GGUF's rope_freqs.weight, llama.cpp's form of llama3 scaling):
  // inv_freq[i] /= freq_factors[i], one per frequency [head_dim / 2].
  std::vector<float> freq_factors;
};

struct ModelConfig {
  std::string architecture;  // "llama", "qwen2", "mistral" (from model_type / architectures)
  int hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0,
      vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 0, rope_theta = 0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false, attention_bias = false;
  std::string dtype;  // torch_dtype / dtype as written ("" when absent)
  std::optional<int> bos_token_id;
  std::vector<int> eos_token_ids;  // config.json and generation_config.json merged

  // Reads model_dir/config.json and, if present, model_dir/generation_config.json.
  static ModelConfig load(const std::filesystem::path& model_dir);  // throws ModelFileError naming the field
  // Parses config.json text (and optional generation_config.json text); `source` names the file.
  static ModelConfig from_json_text(std::string_view config_json, std::string_view source = "config.json",
                                    std::optional<std::string_view> generation_config_json = std::nullopt);
};

}  // namespace kvslim::engine
