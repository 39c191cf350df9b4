#include "engine/model_config.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>

#include "engine/json_util.h"
#include "engine/model_file_limits.h"

namespace kvslim::engine {
namespace {

using json_util::Json;
using json_util::Where;

// model_type -> architecture, and the HF class names that imply it.
struct KnownArchitecture {
  std::string_view model_type;
  std::string_view class_name;
};
constexpr std::array<KnownArchitecture, 3> kArchitectures{{
    {"llama", "LlamaForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"mistral", "MistralForCausalLM"},
}};

std::string detect_architecture(const Json& doc, const Where& root) {
  if (const Json* model_type = json_util::find(doc, "model_type", root)) {
    const std::string name = json_util::as_string(*model_type, root.field("model_type"));
    for (const auto& arch : kArchitectures) {
      if (arch.model_type == name) return name;
    }
    json_util::fail(root.field("model_type"), "unknown architecture '" + name + "' (supported: llama, qwen2, mistral)");
  }
  if (const Json* classes = json_util::find(doc, "architectures", root)) {
    const Where where = root.field("architectures");
    json_util::as_array(*classes, where);
    std::string seen;
    for (std::size_t i = 0; i < classes->size(); ++i) {
      const std::string name = json_util::as_string((*classes)[i], where.index(i));
      for (const auto& arch : kArchitectures) {
        if (arch.class_name == name) return std::string(arch.model_type);
      }
      seen += (seen.empty() ? "'" : ", '") + name + "'";
    }
    json_util::fail(where, "unknown architecture " + (seen.empty() ? std::string("(empty list)") : seen) +
                               " (supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)");
  }
  json_util::fail(root.field("model_type"), "required field is missing (and no 'architectures' either)");
}

int require_positive_int(const Json& doc, std::string_view key, const Where& root) {
  const Where where = root.field(key);
  const std::int64_t v = json_util::as_int(json_util::require(doc, key, root), where);
  if (v <= 0 || v > INT_MAX) json_util::fail(where, "must be a positive integer, found " + std::to_string(v));
  return static_cast<int>(v);
}

std::optional<int> optional_positive_int(const Json& doc, std::string_view key, const Where& root) {
  if (json_util::find(doc, key, root) == nullptr) return std::nullopt;
  return require_positive_int(doc, key, root);
}

double positive_number(const Json& value, const Where& where) {
  const double v = json_util::as_number(value, where);
  if (!(v > 0) || !std::isfinite(v)) json_util::fail(where, "must be a positive number, found " + value.dump());
  return v;
}

int token_id(const Json& value, const Where& where) {
  const std::int64_t v = json_util::as_int(value, where);
  if (v < 0 || v > INT_MAX) json_util::fail(where, "token id out of range: " + std::to_string(v));
  return static_cast<int>(v);
}

// An eos_token_id given as an int or a list of ints; appended to `out` without repeats.
void read_token_ids(const Json& value, const Where& where, std::vector<int>& out) {
  auto add = [&](int id) {
    if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  };
  if (value.is_array()) {
    for (std::size_t i = 0; i < value.size(); ++i) add(token_id(value[i], where.index(i)));
  } else {
    add(token_id(value, where));
  }
}

// rope_scaling (old) or rope_parameters (transformers 5): type and its parameters.
RopeScaling read_rope_scaling(const Json& params, const Where& where) {
  json_util::as_object(params, where);
  RopeScaling rs;
  std::string type = json_util::get_string(params, "rope_type", where, "");
  if (type.empty()) type = json_util::get_string(params, "type", where, "default");
  if (type == "default" || type == "none") {
    rs.type = "none";
    return rs;
  }
  if (type != "linear" && type != "llama3") {
    json_util::fail(where.field("rope_type"), "unsupported RoPE scaling type '" + type + "' (supported: default, linear, llama3)");
  }
  rs.type = type;
  rs.factor = positive_number(json_util::require(params, "factor", where), where.field("factor"));
  if (type == "llama3") {
    rs.low_freq_factor = positive_number(json_util::require(params, "low_freq_factor", where), where.field("low_freq_factor"));
    rs.high_freq_factor = positive_number(json_util::require(params, "high_freq_factor", where), where.field("high_freq_factor"));
    if (rs.high_freq_factor <= rs.low_freq_factor) {
      json_util::fail(where.field("high_freq_factor"), "must be greater than low_freq_factor");
    }
    rs.original_max_position_embeddings = require_positive_int(params, "original_max_position_embeddings", where);
  }
  return rs;
}

ModelConfig parse_config(std::string_view config_json, std::string_view source,
                         std::optional<std::string_view> generation_config_json, std::string_view gen_source) {
  const Json doc = json_util::parse(config_json, source);
  const Where root{source, ""};
  if (!doc.is_object()) json_util::fail(root, std::string("expected a JSON object, found ") + doc.type_name());

  ModelConfig c;
  c.architecture = detect_architecture(doc, root);
  c.hidden_size = require_positive_int(doc, "hidden_size", root);
  c.intermediate_size = require_positive_int(doc, "intermediate_size", root);
  c.num_layers = require_positive_int(doc, "num_hidden_layers", root);
  c.num_heads = require_positive_int(doc, "num_attention_heads", root);
  c.vocab_size = require_positive_int(doc, "vocab_size", root);
  c.max_position_embeddings = require_positive_int(doc, "max_position_embeddings", root);
  c.num_kv_heads = optional_positive_int(doc, "num_key_value_heads", root).value_or(c.num_heads);
  if (auto head_dim = optional_positive_int(doc, "head_dim", root)) {
    c.head_dim = *head_dim;  // explicit head_dim need not divide hidden_size (e.g. Mistral-Nemo)
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      json_util::fail(root.field("hidden_size"), std::to_string(c.hidden_size) + " is not divisible by num_attention_heads " +
                                                     std::to_string(c.num_heads) + " (and head_dim is not given)");
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    json_util::fail(root.field("num_key_value_heads"), std::to_string(c.num_kv_heads) +
                                                           " does not divide num_attention_heads " + std::to_string(c.num_heads));
  }
  c.rms_norm_eps = positive_number(json_util::require(doc, "rms_norm_eps", root), root.field("rms_norm_eps"));

  // RoPE: transformers 5 nests everything in rope_parameters; older files use top-level fields.
  c.rope_theta = 10000.0;  // the HF default for all three architectures
  if (const Json* params = json_util::find(doc, "rope_parameters", root)) {
    const Where where = root.field("rope_parameters");
    json_util::as_object(*params, where);
    if (const Json* theta = json_util::find(*params, "rope_theta", where)) c.rope_theta = positive_number(*theta, where.field("rope_theta"));
    c.rope_scaling = read_rope_scaling(*params, where);
  } else {
    if (const Json* theta = json_util::find(doc, "rope_theta", root)) c.rope_theta = positive_number(*theta, root.field("rope_theta"));
    if (const Json* scaling = json_util::find(doc, "rope_scaling", root)) c.rope_scaling = read_rope_scaling(*scaling, root.field("rope_scaling"));
  }

  c.tie_word_embeddings = json_util::get_bool(doc, "tie_word_embeddings", root, false);
  // Qwen2 always has q/k/v biases (no field); Llama reads attention_bias; Mistral has none.
  if (c.architecture == "qwen2") c.attention_bias = true;
  else c.attention_bias = json_util::get_bool(doc, "attention_bias", root, false);
  c.dtype = json_util::get_string(doc, "dtype", root, "");
  if (c.dtype.empty()) c.dtype = json_util::get_string(doc, "torch_dtype", root, "");

  if (const Json* bos = json_util::find(doc, "bos_token_id", root)) c.bos_token_id = token_id(*bos, root.field("bos_token_id"));
  if (const Json* eos = json_util::find(doc, "eos_token_id", root)) read_token_ids(*eos, root.field("eos_token_id"), c.eos_token_ids);

  if (generation_config_json) {
    const Json gen = json_util::parse(*generation_config_json, gen_source);
    const Where gen_root{gen_source, ""};
    if (!gen.is_object()) json_util::fail(gen_root, std::string("expected a JSON object, found ") + gen.type_name());
    if (!c.bos_token_id) {
      if (const Json* bos = json_util::find(gen, "bos_token_id", gen_root)) c.bos_token_id = token_id(*bos, gen_root.field("bos_token_id"));
    }
    if (const Json* eos = json_util::find(gen, "eos_token_id", gen_root)) read_token_ids(*eos, gen_root.field("eos_token_id"), c.eos_token_ids);
  }
  return c;
}

}  // namespace

ModelConfig ModelConfig::from_json_text(std::string_view config_json, std::string_view source,
                                        std::optional<std::string_view> generation_config_json) {
  return parse_config(config_json, source, generation_config_json, "generation_config.json");
}

ModelConfig ModelConfig::load(const std::filesystem::path& model_dir) {
  const std::filesystem::path config_path = model_dir / "config.json";
  const std::string text = json_util::read_text_file(config_path, limits::kConfigJsonBytes);
  const std::filesystem::path gen_path = model_dir / "generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen_path, ec)) {
    const std::string gen_text = json_util::read_text_file(gen_path, limits::kConfigJsonBytes);
    return parse_config(text, config_path.string(), gen_text, gen_path.string());
  }
  return parse_config(text, config_path.string(), std::nullopt, "");
}

}  // namespace kvslim::engine
