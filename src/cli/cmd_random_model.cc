// `kvslim random-model`: writes a random Llama-family model directory (config.json,
// model.safetensors, optionally a byte-level tokenizer.json) for tests and engine benchmarks.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/option_checks.h"
#include "engine/random_model.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;

struct Options {
  std::string out, dtype = "bf16", architecture = "llama";
  RandomModelSpec spec{.vocab_size = 258, .byte_tokenizer = true};
  bool force = false;
};

WeightType parse_dtype(const std::string& s) {
  if (s == "f32") return WeightType::f32;
  if (s == "f16") return WeightType::f16;
  if (s == "bf16") return WeightType::bf16;
  throw std::invalid_argument("--dtype '" + s + "': expected f32, f16 or bf16");
}

const CommandRegistrar registrar("random-model", "write a random model directory (tests, engine benchmarks)",
                                 [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  RandomModelSpec& s = o->spec;
  app.add_option("--out", o->out, "directory to write (new or empty; a non-empty one needs --force)")->required();
  app.add_flag("--force", o->force, "replace the model files of a non-empty --out directory");
  app.add_option("--architecture", o->architecture, "model_type")->capture_default_str()
      ->check(CLI::IsMember({"llama", "qwen2", "mistral"}));
  app.add_option("--dtype", o->dtype, "weight type")->capture_default_str()->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--hidden", s.hidden_size, "hidden_size")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--intermediate", s.intermediate_size, "intermediate_size")->capture_default_str()->check(CLI::Range(1, 1 << 18));
  app.add_option("--layers", s.num_layers, "num_hidden_layers")->capture_default_str()->check(CLI::Range(1, 512));
  app.add_option("--heads", s.num_heads, "num_attention_heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", s.num_kv_heads, "num_key_value_heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--head-dim", s.head_dim, "head_dim (even)")->capture_default_str()->check(CLI::Range(2, 1024));
  app.add_option("--vocab", s.vocab_size, "vocab_size (>= 258 with the byte tokenizer)")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-positions", s.max_position_embeddings, "max_position_embeddings")->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--seed", s.seed, "weights seed")->capture_default_str();
  app.add_flag("--tie,!--no-tie", s.tie_word_embeddings, "tie lm_head to the embedding")->capture_default_str();
  app.add_flag("--tokenizer,!--no-tokenizer", s.byte_tokenizer, "write a byte-level tokenizer.json")->capture_default_str();
  return [o] {
    o->spec.dtype = parse_dtype(o->dtype);
    o->spec.architecture = o->architecture;
    check_output_dir(o->out, "--out", o->force);
    write_random_model(o->out, o->spec, o->force);
    std::printf("wrote %s\n", o->out.c_str());
    return 0;
  };
});

}  // namespace
}  // namespace kvslim::cli
