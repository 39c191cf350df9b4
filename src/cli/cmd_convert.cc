// `kvslim convert`: an HF model directory to a GGUF v3 file that llama.cpp and kvslim both load
// (llama.cpp's tensor names and metadata, q/k rows permuted for llama-arch, gpt2 BPE tokenizer).
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/option_checks.h"
#include "engine/model_file_limits.h"
#include "engine/gguf_model.h"
#include "engine/json_util.h"
#include "engine/model.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;

struct Options {
  std::string model, out, type = "f16";
  bool no_hf_tokenizer = false;
};

// llama.cpp's Q4_K_M mix (llama-quantize's choice for LLAMA_FTYPE_MOSTLY_Q4_K_M): Q4_K, except
// output.weight in Q6_K, and attn_v / ffn_down in Q6_K on the layers that get more bits (the first
// and last eighth, and every third between).
std::function<gguf::TensorType(const std::string&, gguf::TensorType)> q4_k_m_mix(int n_layers) {
  return [n_layers](const std::string& name, gguf::TensorType chosen) {
    if (name == "output.weight") return gguf::TensorType::q6_k;
    if (name.rfind("blk.", 0) == 0 && (name.ends_with(".attn_v.weight") || name.ends_with(".ffn_down.weight"))) {
      const int i = std::stoi(name.substr(4));
      const bool more_bits = i < n_layers / 8 || i >= 7 * n_layers / 8 || (i - n_layers / 8) % 3 == 2;
      if (more_bits) return gguf::TensorType::q6_k;
    }
    return chosen;
  };
}

int run(const Options& o) {
  if (is_gguf_path(o.model)) throw std::invalid_argument(o.model + ": already a GGUF file (convert reads an HF model directory)");
  // The output is checked before anything is read: never one of the model's own files.
  check_outputs({{o.out, "output"}}, model_inputs(o.model, "model"));
  const Model model = Model::load(o.model);
  const std::filesystem::path tok_path = std::filesystem::path(o.model) / "tokenizer.json";
  std::string tokenizer_json;
  if (std::filesystem::exists(tok_path)) {
    tokenizer_json = json_util::read_text_file(tok_path, limits::kTokenizerJsonBytes);
  } else {
    std::fprintf(stderr, "kvslim convert: warning: %s not found; the GGUF has no tokenizer (llama.cpp needs one)\n",
                 tok_path.string().c_str());
  }
  GgufExportOptions options;
  if (o.type == "q4_k_m") {
    options.matrix_type = gguf::TensorType::q4_k;
    options.override_type = q4_k_m_mix(model.config().num_layers);
  } else {
    options.matrix_type = parse_tensor_type(o.type);
  }
  options.embed_hf_tokenizer = !o.no_hf_tokenizer;
  write_gguf(model, tokenizer_json, o.out, options);
  std::printf("wrote %s (%s matrices, %ju bytes)\n", o.out.c_str(), o.type.c_str(),
              static_cast<std::uintmax_t>(std::filesystem::file_size(o.out)));
  return 0;
}

const CommandRegistrar registrar(
    "convert", "write an HF model directory as a GGUF file (for llama.cpp, and readable by kvslim)",
    [](CLI::App& app) {
      auto o = std::make_shared<Options>();
      app.add_option("model", o->model, "HF model directory (config.json, *.safetensors, tokenizer.json)")->required();
      app.add_option("out", o->out, "output .gguf file (written to a temporary file beside it, then renamed; never one of the model's files)")->required();
      app.add_option("--type", o->type,
                     "weight matrix type: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, or q4_k_m (llama.cpp's mix: "
                     "Q4_K with Q6_K for output and some attn_v / ffn_down); K-quants use a simple round-to-nearest "
                     "encoder, not llama-quantize's search (norms and biases stay f32)")
          ->capture_default_str()
          ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m"}));
      app.add_flag("--no-hf-tokenizer", o->no_hf_tokenizer,
                   "do not embed tokenizer.json (kvslim then rebuilds the tokenizer from tokenizer.ggml.*)");
      return [o] { return run(*o); };
    });

}  // namespace
}  // namespace kvslim::cli
