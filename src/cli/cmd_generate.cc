// `kvslim generate`: a prompt through the engine with any kvslim method; streams the text, then
// reports throughput and each layer's resident KV bytes against the full fp16 equivalent.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/option_checks.h"
#include "engine/text_input.h"
#include "engine/generate.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "kvslim/config.h"
#include "kvslim/factory.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;

struct Options {
  std::string model, prompt, prompt_file, method = "full", prefill_attention = "cache_view";
  std::vector<std::string> sets;
  int max_tokens = 128, top_k = 0, threads = 2;
  std::size_t prefill_chunk = 0;
  float temperature = 0.0f, top_p = 1.0f;
  std::uint64_t seed = 0;
  bool json = false, allow_long_context = false;
};

// --prompt-file: the whole file, or standard input for "-" (prompts too long for a command line);
// bounded (engine/text_input.h).
std::string read_prompt_file(const std::string& path) { return read_text_input(path, "--prompt-file"); }

KVCacheConfig cache_config(const std::string& method, const std::vector<std::string>& sets) {
  KVCacheConfig cfg;
  cfg.method = method;
  for (const std::string& kv : sets) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw std::invalid_argument("--set '" + kv + "': expected key=value (e.g. h2o_budget=256)");
    }
    cfg.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  cfg.validate();
  return cfg;
}

int run(const Options& o_in) {
  Options o = o_in;
  if (!o.prompt_file.empty()) o.prompt = read_prompt_file(o.prompt_file);
  if (o.prompt.empty()) {
    throw std::invalid_argument(o.prompt_file.empty() ? "the prompt is empty (pass --prompt TEXT or --prompt-file FILE)"
                                                      : "--prompt-file " + o.prompt_file + ": the file is empty");
  }
  const Model model = Model::load(o.model);
  const Tokenizer tokenizer = load_model_tokenizer(o.model);
  const KVCacheConfig cfg = cache_config(o.method, o.sets);
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), cfg);
  ForwardOptions fwd;
  fwd.prefill_attention = parse_prefill_attention(o.prefill_attention);
  fwd.prefill_chunk = o.prefill_chunk;
  fwd.threads = o.threads;
  fwd.allow_past_max_positions = o.allow_long_context;
  Transformer transformer(model, caches, fwd);

  GenerateOptions gen;
  gen.max_tokens = o.max_tokens;
  gen.sampler = SamplerConfig{o.temperature, o.top_k, o.top_p, o.seed};
  gen.sampler.validate();
  gen.stop_ids = model.config().eos_token_ids;

  auto stream = [&](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  const GenerateResult r = o.json ? generate_text(transformer, tokenizer, o.prompt, gen)
                                  : generate_text(transformer, tokenizer, o.prompt, gen, stream);

  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (std::size_t l = 0; l < caches.size(); ++l) {
    const CacheStats s = caches.at(l).stats();
    layers.push_back({{"layer", l}, {"tokens_kept", s.tokens_kept}, {"resident_bytes", s.resident_bytes},
                      {"fp16_equivalent_bytes", s.seen_fp16_bytes}});
  }
  const std::size_t resident = caches.resident_bytes(), fp16 = caches.seen_fp16_bytes();
  const double ratio = resident > 0 ? static_cast<double>(fp16) / static_cast<double>(resident) : 1.0;
  if (o.json) {
    nlohmann::ordered_json out = {
        {"method", cfg.method},
        {"prompt", o.prompt},
        {"text", r.text},
        {"prompt_tokens", r.prompt_ids.size()},
        {"generated_tokens", r.generated_ids.size()},
        {"generated_ids", r.generated_ids},
        {"stopped_at_eos", r.stopped_at_eos},
        {"prefill_tokens_per_second", r.prefill_tokens_per_second()},
        {"decode_tokens_per_second", r.decode_tokens_per_second()},
        {"kv_resident_bytes", resident},
        {"kv_fp16_equivalent_bytes", fp16},
        {"kv_compression_ratio", ratio},
        {"layers", layers},
    };
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("\n\n-- %s: prompt %zu tokens at %.1f tok/s, generated %zu tokens at %.1f tok/s%s\n", cfg.method.c_str(),
              r.prompt_ids.size(), r.prefill_tokens_per_second(), r.generated_ids.size(),
              r.decode_tokens_per_second(), r.stopped_at_eos ? " (stopped at EOS)" : "");
  std::printf("-- KV cache per layer (kept tokens, resident bytes / fp16 equivalent):\n");
  for (const auto& L : layers) {
    std::printf("   layer %3zu: %6zu tokens  %10zu / %10zu bytes\n", L["layer"].get<std::size_t>(),
                L["tokens_kept"].get<std::size_t>(), L["resident_bytes"].get<std::size_t>(),
                L["fp16_equivalent_bytes"].get<std::size_t>());
  }
  std::printf("-- KV cache total: %zu bytes resident vs %zu bytes as full fp16 (%.2fx)\n", resident, fp16, ratio);
  return 0;
}

const CommandRegistrar registrar("generate", "generate text with a model through a kvslim cache", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "model directory (config.json, *.safetensors, tokenizer.json)")->required();
  auto* prompt = app.add_option("--prompt", o->prompt, "prompt text");
  auto* prompt_file = app.add_option("--prompt-file", o->prompt_file, "read the prompt from this file ('-': standard input)");
  prompt->excludes(prompt_file);
  app.add_option("--max-tokens", o->max_tokens, "new tokens at most")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--method", o->method, "KV cache method")->capture_default_str()->check(CLI::IsMember(method_names()));
  app.add_option("--set", o->sets, "cache option key=value (any KVCacheConfig field; repeatable)");
  app.add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str()->check(finite_range(0.0, 1000.0));
  app.add_option("--top-k", o->top_k, "keep the k most likely tokens (0 = all)")->capture_default_str()->check(CLI::Range(0, 1 << 30));
  app.add_option("--top-p", o->top_p, "nucleus mass in (0, 1]")->capture_default_str()->check(finite_range(1e-9, 1.0));
  app.add_option("--seed", o->seed, "sampler seed")->capture_default_str();
  app.add_option("--prefill-chunk", o->prefill_chunk, "prompt tokens per forward call (0 = whole prompt)")->capture_default_str()
      ->check(CLI::Range(0, 1 << 26));
  app.add_option("--prefill-attention", o->prefill_attention,
                 "cache_view: prompt queries see what the cache keeps (evict while prefilling); "
                 "full_prompt: they see the whole prompt, the cache evicts after")
      ->capture_default_str()
      ->check(CLI::IsMember({"cache_view", "full_prompt"}));
  app.add_option("--threads", o->threads, "decode threads")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_flag("--json", o->json, "print one JSON object instead of streaming text");
  app.add_flag("--allow-long-context", o->allow_long_context,
               "run positions past the model's max_position_embeddings (refused by default: untrained there)");
  return [o] { return run(*o); };
});

}  // namespace
}  // namespace kvslim::cli
