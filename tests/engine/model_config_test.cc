// Tests for config.json loading: old and transformers-5 field names, defaults, the three
// architectures, generation_config.json merging, and errors naming the field.
#include "engine/model_config.h"

#include <gtest/gtest.h>

#include "engine/loader_test_util.h"

namespace kvslim::engine {
namespace {

using nlohmann::json;
using testing::TempDir;
using testing::expect_error;
using testing::write_file;

// A Llama-3.2-1B-like config.json in the transformers 4 spelling.
json llama_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": true, "attention_bias": false, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})");
}

ModelConfig parse(const json& j) { return ModelConfig::from_json_text(j.dump()); }

TEST(ModelConfig, LlamaOldFieldNames) {
  const ModelConfig c = parse(llama_config());
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_layers, 16);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
}

TEST(ModelConfig, Transformers5FieldNames) {
  json j = llama_config();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  j["rope_parameters"] = {{"rope_theta", 250000.0}, {"rope_type", "llama3"}, {"factor", 8.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  const ModelConfig c = parse(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 250000.0);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.dtype, "float16");

  j["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  const ModelConfig plain = parse(j);
  EXPECT_DOUBLE_EQ(plain.rope_theta, 1000000.0);
  EXPECT_EQ(plain.rope_scaling.type, "none");
}

TEST(ModelConfig, Defaults) {
  json j = llama_config();
  for (const char* key : {"head_dim", "num_key_value_heads", "rope_theta", "rope_scaling", "tie_word_embeddings",
                          "attention_bias", "torch_dtype", "bos_token_id", "eos_token_id"}) {
    j.erase(key);
  }
  j["rope_scaling"] = nullptr;
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.head_dim, 2048 / 32);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, "none");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.dtype, "");
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_TRUE(c.eos_token_ids.empty());
}

TEST(ModelConfig, LlamaAttentionBiasField) {
  json j = llama_config();
  j["attention_bias"] = true;
  EXPECT_TRUE(parse(j).attention_bias);
}

TEST(ModelConfig, Qwen2HasBiasByDefaultAndIntEos) {
  const json j = json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "sliding_window": 32768,
    "bos_token_id": 151643, "eos_token_id": 151645})");
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.architecture, "qwen2");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{151645}));
}

TEST(ModelConfig, ArchitectureFromClassNameOnly) {
  json j = llama_config();
  j.erase("model_type");
  j["architectures"] = {"MistralForCausalLM"};
  EXPECT_EQ(parse(j).architecture, "mistral");
}

TEST(ModelConfig, UnknownArchitectureIsNamed) {
  json j = llama_config();
  j["model_type"] = "gpt_neox";
  expect_error([&] { parse(j); }, {"config.json", "model_type", "gpt_neox"});
  j.erase("model_type");
  j["architectures"] = {"GPTNeoXForCausalLM"};
  expect_error([&] { parse(j); }, {"architectures", "GPTNeoXForCausalLM"});
  j.erase("architectures");
  expect_error([&] { parse(j); }, {"model_type", "missing"});
}

TEST(ModelConfig, MissingRequiredFieldIsNamed) {
  for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "vocab_size", "max_position_embeddings", "rms_norm_eps"}) {
    json j = llama_config();
    j.erase(key);
    expect_error([&] { parse(j); }, {"config.json", key, "missing"});
  }
}

TEST(ModelConfig, ValuesOutOfRange) {
  json j = llama_config();
  j.erase("head_dim");
  j["num_attention_heads"] = 30;  // 2048 % 30 != 0
  j["num_key_value_heads"] = 6;
  expect_error([&] { parse(j); }, {"hidden_size", "num_attention_heads 30"});
  j = llama_config();
  j["num_key_value_heads"] = 5;  // 32 % 5 != 0
  expect_error([&] { parse(j); }, {"num_key_value_heads", "5"});
  j = llama_config();
  j["num_hidden_layers"] = 0;
  expect_error([&] { parse(j); }, {"num_hidden_layers", "positive"});
  j = llama_config();
  j["hidden_size"] = "2048";
  expect_error([&] { parse(j); }, {"hidden_size", "integer"});
  j = llama_config();
  j["rms_norm_eps"] = -1.0;
  expect_error([&] { parse(j); }, {"rms_norm_eps", "positive"});
  j = llama_config();
  j["eos_token_id"] = {128001, -1};
  expect_error([&] { parse(j); }, {"eos_token_id[1]"});
}

TEST(ModelConfig, RopeScalingErrors) {
  json j = llama_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  expect_error([&] { parse(j); }, {"rope_scaling", "yarn"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_error([&] { parse(j); }, {"rope_scaling.low_freq_factor", "missing"});
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_EQ(parse(j).rope_scaling.type, "linear");
  EXPECT_DOUBLE_EQ(parse(j).rope_scaling.factor, 2.0);
}

TEST(ModelConfig, BadJson) {
  expect_error([] { ModelConfig::from_json_text("{\"hidden_size\": ", "cfg.json"); }, {"cfg.json", "invalid JSON"});
  expect_error([] { ModelConfig::from_json_text("[]", "cfg.json"); }, {"cfg.json", "object"});
  expect_error([] { ModelConfig::from_json_text(R"({"rope_theta": 1e400})", "cfg.json"); }, {"cfg.json", "invalid JSON"});
}

TEST(ModelConfig, LoadMergesGenerationConfig) {
  TempDir dir;
  json j = llama_config();
  j["eos_token_id"] = 128001;
  j.erase("bos_token_id");
  write_file(dir / "config.json", j.dump());
  write_file(dir / "generation_config.json", R"({"bos_token_id": 128000, "eos_token_id": [128001, 128009]})");
  const ModelConfig c = ModelConfig::load(dir.path());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128001, 128009}));
  EXPECT_EQ(c.bos_token_id, 128000);

  write_file(dir / "generation_config.json", R"({"eos_token_id": "x"})");
  expect_error([&] { ModelConfig::load(dir.path()); }, {(dir / "generation_config.json").string(), "eos_token_id"});
  std::filesystem::remove(dir / "generation_config.json");
  EXPECT_EQ(ModelConfig::load(dir.path()).eos_token_ids, (std::vector<int>{128001}));
}

TEST(ModelConfig, LoadMissingFile) {
  TempDir dir;
  expect_error([&] { ModelConfig::load(dir.path()); }, {"config.json", "cannot open"});
}

}  // namespace
}  // namespace kvslim::engine
