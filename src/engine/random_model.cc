#include "engine/random_model.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>
#include <vector>

#include "engine/pretokenizer.h"
#include "engine/sampler.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {

namespace {

struct PendingTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
};

std::vector<std::uint8_t> encode(const std::vector<float>& values, WeightType type) {
  std::vector<std::uint8_t> out(values.size() * weight_type_size(type));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (type == WeightType::f32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const std::uint16_t h = type == WeightType::f16 ? f32_to_fp16(values[i]) : f32_to_bf16(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

void write_byte_tokenizer(const std::filesystem::path& path) {
  using nlohmann::ordered_json;
  ordered_json vocab = ordered_json::object();
  const ByteLevelTable& table = ByteLevelTable::get();
  for (int b = 0; b < 256; ++b) vocab[table.byte_to_char[b]] = b;
  auto special = [](int id, const char* content) {
    return ordered_json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                        {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  const ordered_json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                                   {"use_regex", true}};
  const ordered_json tok = {
      {"version", "1.0"},
      {"added_tokens", {special(256, "<s>"), special(257, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", ordered_json::array()},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {256}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
        {"merges", ordered_json::array()}}},
  };
  std::ofstream out(path);
  out << tok.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

void write_random_model(const std::filesystem::path& dir, const RandomModelSpec& spec) {
  // Only models the loader and engine accept: a written model that `generate` then refuses helps
  // no one.
  auto positive = [](int v, const char* field) {
    if (v <= 0) throw std::invalid_argument("random model: " + std::string(field) + " must be > 0, got " + std::to_string(v));
  };
  positive(spec.hidden_size, "hidden_size");
  positive(spec.intermediate_size, "intermediate_size");
  positive(spec.num_layers, "num_layers");
  positive(spec.num_heads, "num_heads");
  positive(spec.num_kv_heads, "num_kv_heads");
  positive(spec.head_dim, "head_dim");
  positive(spec.vocab_size, "vocab_size");
  positive(spec.max_position_embeddings, "max_position_embeddings");
  if (spec.head_dim % 2 != 0) {
    throw std::invalid_argument("random model: head_dim must be even (RoPE rotates pairs of dimensions), got " +
                                std::to_string(spec.head_dim));
  }
  if (spec.num_heads % spec.num_kv_heads != 0) {
    throw std::invalid_argument("random model: num_heads " + std::to_string(spec.num_heads) +
                                " must be a multiple of num_kv_heads " + std::to_string(spec.num_kv_heads));
  }
  if (spec.byte_tokenizer && spec.vocab_size < 258) {
    throw std::invalid_argument("random model: byte_tokenizer needs vocab_size >= 258, got " +
                                std::to_string(spec.vocab_size));
  }
  std::filesystem::create_directories(dir);
  Rng rng(spec.seed);
  std::vector<PendingTensor> tensors;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, float center, float spread) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    std::vector<float> v(n);
    for (float& x : v) x = center + spread * (2.0f * rng.uniform() - 1.0f);
    tensors.push_back({name, std::move(shape), encode(v, spec.dtype)});
  };
  const std::int64_t hidden = spec.hidden_size, inter = spec.intermediate_size, vocab = spec.vocab_size;
  const std::int64_t q_dim = static_cast<std::int64_t>(spec.num_heads) * spec.head_dim;
  const std::int64_t kv_dim = static_cast<std::int64_t>(spec.num_kv_heads) * spec.head_dim;
  auto fan = [](std::int64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); };
  const bool bias = spec.attention_bias || spec.architecture == "qwen2";

  add("model.embed_tokens.weight", {vocab, hidden}, 0.0f, 1.0f);
  for (int l = 0; l < spec.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {hidden}, 1.0f, 0.2f);
    add(p + "post_attention_layernorm.weight", {hidden}, 1.0f, 0.2f);
    add(p + "self_attn.q_proj.weight", {q_dim, hidden}, 0.0f, 2.0f * fan(hidden));
    add(p + "self_attn.k_proj.weight", {kv_dim, hidden}, 0.0f, 2.0f * fan(hidden));
    add(p + "self_attn.v_proj.weight", {kv_dim, hidden}, 0.0f, fan(hidden));
    add(p + "self_attn.o_proj.weight", {hidden, q_dim}, 0.0f, fan(q_dim));
    if (bias) {
      add(p + "self_attn.q_proj.bias", {q_dim}, 0.0f, 0.5f);
      add(p + "self_attn.k_proj.bias", {kv_dim}, 0.0f, 0.5f);
      add(p + "self_attn.v_proj.bias", {kv_dim}, 0.0f, 0.5f);
    }
    add(p + "mlp.gate_proj.weight", {inter, hidden}, 0.0f, fan(hidden));
    add(p + "mlp.up_proj.weight", {inter, hidden}, 0.0f, fan(hidden));
    add(p + "mlp.down_proj.weight", {hidden, inter}, 0.0f, fan(inter));
  }
  add("model.norm.weight", {hidden}, 1.0f, 0.2f);
  if (!spec.tie_word_embeddings) add("lm_head.weight", {vocab, hidden}, 0.0f, fan(hidden));

  // safetensors: [u64 header length][JSON header][data], offsets relative to the data section.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", weight_type_name(spec.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::uint64_t header_len = header_text.size();
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&header_len), 8);
  out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (dir / "model.safetensors").string());

  nlohmann::ordered_json config = {
      {"architectures", {spec.architecture == "qwen2" ? "Qwen2ForCausalLM"
                         : spec.architecture == "mistral" ? "MistralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", spec.architecture},
      {"hidden_size", spec.hidden_size},
      {"intermediate_size", spec.intermediate_size},
      {"num_hidden_layers", spec.num_layers},
      {"num_attention_heads", spec.num_heads},
      {"num_key_value_heads", spec.num_kv_heads},
      {"head_dim", spec.head_dim},
      {"vocab_size", spec.vocab_size},
      {"max_position_embeddings", spec.max_position_embeddings},
      {"rms_norm_eps", spec.rms_norm_eps},
      {"rope_theta", spec.rope_theta},
      {"tie_word_embeddings", spec.tie_word_embeddings},
      {"attention_bias", bias},
      {"torch_dtype", spec.dtype == WeightType::f32 ? "float32" : spec.dtype == WeightType::f16 ? "float16" : "bfloat16"},
      {"bos_token_id", spec.byte_tokenizer ? 256 : 1},
      {"eos_token_id", spec.byte_tokenizer ? 257 : 2},
  };
  if (spec.rope_scaling.type == "linear") {
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", spec.rope_scaling.factor}};
  } else if (spec.rope_scaling.type == "llama3") {
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", spec.rope_scaling.factor},
                              {"low_freq_factor", spec.rope_scaling.low_freq_factor},
                              {"high_freq_factor", spec.rope_scaling.high_freq_factor},
                              {"original_max_position_embeddings", spec.rope_scaling.original_max_position_embeddings}};
  }
  std::ofstream cfg(dir / "config.json");
  cfg << config.dump(2) << "\n";
  if (!cfg) throw std::runtime_error("cannot write " + (dir / "config.json").string());
  if (spec.byte_tokenizer) write_byte_tokenizer(dir / "tokenizer.json");
}

}  // namespace kvslim::engine
