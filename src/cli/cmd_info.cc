// `kvslim info`: what a model directory holds -- architecture, sizes, parameters, weight types,
// tokenizer vocabulary and special tokens.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;

struct Options {
  std::string model;
  bool json = false;
};

int run(const Options& o) {
  const Model model = Model::load(o.model);
  const ModelConfig& c = model.config();
  std::map<std::string, std::uint64_t> types;  // stored weight type -> elements
  for (const std::string& name : model.store().names()) {
    const TensorInfo* t = model.store().find(name);
    types[weight_type_name(t->type)] += weight_elements(t->type, t->nbytes);
  }
  nlohmann::ordered_json out = {
      {"model", o.model},
      {"architecture", c.architecture},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_layers", c.num_layers},
      {"num_heads", c.num_heads},
      {"num_kv_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", c.rope_scaling.type},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"attention_bias", !model.weights().layers.empty() && !model.weights().layers[0].bq.empty()},
      {"dtype", c.dtype},
      {"parameters", model.parameter_count()},
      {"weight_types", types},
      {"kv_fp16_bytes_per_token", 2ull * 2 * c.num_layers * c.num_kv_heads * c.head_dim},
  };
  const std::filesystem::path tok_path = std::filesystem::path(o.model) / "tokenizer.json";
  nlohmann::ordered_json special = nlohmann::ordered_json::object();
  auto describe = [](const Tokenizer* tok, int id) {
    nlohmann::ordered_json t = {{"id", id}};
    if (tok != nullptr && id >= 0 && id < tok->vocab_size()) t["text"] = tok->token_bytes(id);
    return t;
  };
  std::unique_ptr<Tokenizer> tok;
  if (is_gguf_path(o.model) || std::filesystem::exists(tok_path)) {
    tok = std::make_unique<Tokenizer>(load_model_tokenizer(o.model));
    out["tokenizer_vocab"] = tok->vocab_size();
  } else {
    out["tokenizer_vocab"] = nullptr;  // no tokenizer.json: `generate` needs one
  }
  const std::optional<int> bos = c.bos_token_id ? c.bos_token_id : (tok ? tok->bos_id() : std::nullopt);
  if (bos) special["bos"] = describe(tok.get(), *bos);
  nlohmann::ordered_json eos = nlohmann::ordered_json::array();
  for (int id : c.eos_token_ids) eos.push_back(describe(tok.get(), id));
  special["eos"] = eos;
  out["special_tokens"] = special;

  if (o.json) {
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("%s: %s, %d layers, hidden %d, intermediate %d, heads %d (kv %d) x %d, vocab %d\n", o.model.c_str(),
              c.architecture.c_str(), c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
              c.head_dim, c.vocab_size);
  std::printf("parameters: %llu (%.2f M)\n", static_cast<unsigned long long>(model.parameter_count()),
              model.parameter_count() / 1e6);
  std::printf("dtype: %s; stored:", c.dtype.empty() ? "(not given)" : c.dtype.c_str());
  for (const auto& [type, n] : types) std::printf(" %s x %llu", type.c_str(), static_cast<unsigned long long>(n));
  std::printf("\nrope: theta %g, scaling %s; rms_norm_eps %g; tied embeddings: %s; q/k/v bias: %s\n", c.rope_theta,
              c.rope_scaling.type.c_str(), c.rms_norm_eps, c.tie_word_embeddings ? "yes" : "no",
              out["attention_bias"].get<bool>() ? "yes" : "no");
  std::printf("max positions: %d; KV cache as fp16: %llu bytes per token\n", c.max_position_embeddings,
              static_cast<unsigned long long>(out["kv_fp16_bytes_per_token"].get<std::uint64_t>()));
  if (tok) {
    std::printf("tokenizer: %d tokens\n", tok->vocab_size());
  } else {
    std::printf("tokenizer: no tokenizer.json\n");
  }
  auto show = [](const nlohmann::ordered_json& t) {
    return std::to_string(t["id"].get<int>()) + (t.contains("text") ? " " + nlohmann::json(t["text"]).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) : "");
  };
  if (special.contains("bos")) std::printf("bos: %s\n", show(special["bos"]).c_str());
  for (const auto& e : eos) std::printf("eos: %s\n", show(e).c_str());
  return 0;
}

const CommandRegistrar registrar("info", "describe a model directory", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "model directory (config.json, *.safetensors, tokenizer.json)")->required();
  app.add_flag("--json", o->json, "print one JSON object");
  return [o] { return run(*o); };
});

}  // namespace
}  // namespace kvslim::cli
