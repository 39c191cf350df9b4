#include "engine/random_model.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>
#include <vector>

#include "engine/output_file.h"
#include "engine/pretokenizer.h"
#include "engine/sampler.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {

namespace {

// A tensor to generate: its values are drawn only when it is written, so the file is streamed
// (one tensor in memory at a time) in the same order, and so with the same values, as before.
struct PendingTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  float center = 0, spread = 0;
  std::size_t elements() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
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
  AtomicFile out(path, path.string());
  out.write(tok.dump(2) + "\n");
  out.commit();
}

// Writes every file of the model into `dir` (an existing, empty, private directory).
void write_model_files(const std::filesystem::path& dir, const RandomModelSpec& spec);

}  // namespace

void write_random_model(const std::filesystem::path& dir, const RandomModelSpec& spec, bool force) {
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
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  if (existed && !fs::is_directory(dir, ec)) throw std::invalid_argument(dir.string() + ": exists and is not a directory");
  if (existed && !fs::is_empty(dir, ec) && !force) {
    throw std::invalid_argument(dir.string() + ": the directory is not empty (it may hold a model); refusing to write over it");
  }
  // Everything is written into a private directory beside `dir`, then moved into place: a
  // failure (a full disk) leaves `dir` as it was.
  const fs::path parent = dir.has_parent_path() ? dir.parent_path() : fs::path(".");
  fs::create_directories(parent);
  std::string tmpl = (parent / ("." + dir.filename().string() + ".kvslim-tmp-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) {
    throw std::runtime_error(dir.string() + ": cannot create a temporary directory beside it (" + std::strerror(errno) + ")");
  }
  const fs::path tmp(tmpl);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ignored;
      if (!p.empty()) fs::remove_all(p, ignored);
    }
  } cleanup{tmp};
  write_model_files(tmp, spec);
  ::chmod(tmp.c_str(), 0777 & ~[] { const mode_t m = ::umask(0); ::umask(m); return m; }());
  if (!existed || fs::is_empty(dir, ec)) {
    if (existed) fs::remove(dir, ec);
    if (::rename(tmp.c_str(), dir.c_str()) != 0) {
      throw std::runtime_error(dir.string() + ": cannot move the written model into place (" + std::strerror(errno) + ")");
    }
    cleanup.p.clear();
    return;
  }
  // --force over a model directory: its model files go, so it holds one model, not a mix of two.
  for (const fs::path& old : model_input_files(dir)) {
    if (old.filename().string().rfind("heldout", 0) != 0) fs::remove(old, ec);
  }
  for (const auto& entry : fs::directory_iterator(tmp)) {
    if (::rename(entry.path().c_str(), (dir / entry.path().filename()).c_str()) != 0) {
      throw std::runtime_error((dir / entry.path().filename()).string() + ": cannot move into place (" + std::strerror(errno) + ")");
    }
  }
}

namespace {

void write_model_files(const std::filesystem::path& dir, const RandomModelSpec& spec) {
  Rng rng(spec.seed);
  std::vector<PendingTensor> tensors;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, float center, float spread) {
    tensors.push_back({name, std::move(shape), center, spread});
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
    const std::size_t bytes = t.elements() * weight_type_size(spec.dtype);
    header[t.name] = {{"dtype", weight_type_name(spec.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::uint64_t header_len = header_text.size();
  {
    AtomicFile out(dir / "model.safetensors", (dir / "model.safetensors").string());
    out.write(&header_len, 8);
    out.write(header_text);
    std::vector<float> v;
    for (const auto& t : tensors) {  // one tensor in memory at a time
      v.resize(t.elements());
      for (float& x : v) x = t.center + t.spread * (2.0f * rng.uniform() - 1.0f);
      const std::vector<std::uint8_t> bytes = encode(v, spec.dtype);
      out.write(bytes.data(), bytes.size());
    }
    out.commit();
  }

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
  write_file_atomically(dir / "config.json", config.dump(2) + "\n", (dir / "config.json").string());
  if (spec.byte_tokenizer) write_byte_tokenizer(dir / "tokenizer.json");
}

}  // namespace

}  // namespace kvslim::engine
