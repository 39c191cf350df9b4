// `kvslim bench kld`: llama-perplexity's --kl-divergence protocol run by kvslim's engine, so one
// reference file scores both engines on the same tokens. For each chunk of the base file: reset,
// BOS first (when the tokenizer adds one), prefill in micro-batches (as llama.cpp's n_ubatch)
// through the chosen cache, and compare positions n_ctx/2 .. n_ctx-2 with every --ref file
// (mean KL, NLL, same top-1); the KV cache's resident bytes per token after each chunk.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/option_checks.h"
#include "engine/text_input.h"
#include "engine/eval/kld_file.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "kvslim/factory.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;
using namespace kvslim::engine::eval;

struct Options {
  std::string model, method = "full", label, json, write_base;
  std::vector<std::string> refs, sets;
  std::string text;
  std::size_t ubatch = 512, ctx = 512, chunks = 4;
  int threads = 2;
};

int run(const Options& o) {
  if (o.refs.empty() == o.text.empty()) {
    throw std::invalid_argument("give --ref NAME=FILE (its tokens are used) or --text FILE (tokenized here), not both");
  }
  if (!o.text.empty() && o.write_base.empty()) throw std::invalid_argument("--text needs --write-base (nothing to compare with)");
  // Every output checked before any work, and never one of the inputs (a --write-base over the
  // --ref it compares with destroyed hours of llama-perplexity work: issue 26).
  {
    std::vector<FlagPath> inputs = model_inputs(o.model);
    for (const std::string& r : o.refs) {
      if (const auto eq = r.find('='); eq != std::string::npos) inputs.push_back({r.substr(eq + 1), "--ref"});
    }
    if (!o.text.empty()) inputs.push_back({o.text, "--text"});
    check_outputs({{o.write_base, "--write-base"}, {o.json, "--json"}}, inputs);
  }
  const Model model = Model::load(o.model);
  const Tokenizer tokenizer = load_model_tokenizer(o.model);
  const std::optional<int> bos = tokenizer.bos_id();
  std::vector<std::string> names;
  std::vector<std::unique_ptr<KldReader>> readers;
  for (const std::string& r : o.refs) {
    const auto eq = r.find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--ref '" + r + "': expected NAME=FILE");
    names.push_back(r.substr(0, eq));
    readers.push_back(std::make_unique<KldReader>(r.substr(eq + 1)));
    const KldHeader& h = readers.back()->header();
    const KldHeader& h0 = readers.front()->header();
    if (h.n_ctx != h0.n_ctx || h.n_chunk != h0.n_chunk || h.tokens != h0.tokens) {
      throw std::invalid_argument("--ref " + names.back() + ": not the same chunks and tokens as " + names.front());
    }
  }
  KldHeader own;  // --text: chunks of this run's own tokenization
  if (!o.text.empty()) {
    const std::string text = read_text_input(o.text, "--text");
    if (text.empty()) throw std::invalid_argument("--text " + o.text + ": the file is empty");
    const std::vector<int> ids = tokenizer.encode(text, /*add_special_tokens=*/false);
    const std::size_t n_chunk = std::min(o.chunks, ids.size() / o.ctx);  // --ctx >= 4 (its range)
    if (n_chunk == 0) {
      throw std::invalid_argument("--text: " + std::to_string(ids.size()) + " tokens, fewer than one --ctx chunk of " +
                                  std::to_string(o.ctx));
    }
    own.n_ctx = static_cast<std::uint32_t>(o.ctx);
    own.n_vocab = model.config().vocab_size;
    own.n_chunk = static_cast<std::int32_t>(n_chunk);
    own.tokens.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n_chunk * o.ctx));
  }
  const KldHeader& h = readers.empty() ? own : readers.front()->header();
  const std::size_t vocab = model.config().vocab_size, n_ctx = h.n_ctx, first = h.first(), rows = h.rows_per_chunk();
  if (static_cast<std::size_t>(h.n_vocab) != vocab) {
    throw std::invalid_argument("reference vocabulary " + std::to_string(h.n_vocab) + " differs from the model's " + std::to_string(vocab));
  }
  KVCacheConfig cfg;
  cfg.method = o.method;
  for (const std::string& kv : o.sets) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--set '" + kv + "': expected key=value");
    cfg.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  cfg.validate();
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), cfg);
  Transformer t(model, caches, {.threads = o.threads, .prefill_chunk = o.ubatch, .max_chunk = o.ubatch, .max_context = n_ctx});
  std::unique_ptr<KldWriter> writer;
  if (!o.write_base.empty()) writer = std::make_unique<KldWriter>(o.write_base, h);

  std::vector<KldStats> stats(readers.size());
  std::vector<float> scored(rows * vocab);  // logits of positions first .. n_ctx - 2
  double resident_per_token = 0, seconds = 0;
  std::size_t max_resident = 0;
  for (std::int32_t c = 0; c < h.n_chunk; ++c) {
    std::vector<int> tokens(h.tokens.begin() + static_cast<std::ptrdiff_t>(c * n_ctx),
                            h.tokens.begin() + static_cast<std::ptrdiff_t>((c + 1) * n_ctx));
    for (int id : tokens) {
      if (id < 0 || static_cast<std::size_t>(id) >= vocab) throw std::invalid_argument("reference token id " + std::to_string(id) + " outside the vocabulary");
    }
    if (bos) tokens[0] = *bos;
    t.reset();
    const auto t0 = std::chrono::steady_clock::now();
    t.prefill(tokens, [&](std::size_t at, std::span<const float> logits) {
      for (std::size_t s = 0; s < logits.size() / vocab; ++s) {
        const std::size_t pos = at + s;
        if (pos >= first && pos < n_ctx - 1) std::copy_n(logits.begin() + s * vocab, vocab, scored.begin() + (pos - first) * vocab);
      }
    });
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    resident_per_token += static_cast<double>(caches.resident_bytes()) / static_cast<double>(n_ctx);
    max_resident = std::max(max_resident, caches.resident_bytes());
    for (std::size_t k = 0; k < readers.size(); ++k) {
      const std::vector<std::uint16_t>& base = readers[k]->next_chunk();
      for (std::size_t r = 0; r < rows; ++r) {
        stats[k].add(std::span<const float>(scored).subspan(r * vocab, vocab), base.data() + r * h.row_u16(),
                     h.tokens[c * n_ctx + first + r + 1]);
      }
    }
    if (writer) writer->add_chunk(scored);
  }
  if (writer) writer->finish();
  resident_per_token /= h.n_chunk;
  const std::string label = o.label.empty() ? o.method : o.label;
  nlohmann::ordered_json out = {{"engine", "kvslim"},
                                {"label", label},
                                {"method", o.method},
                                {"sets", o.sets},
                                {"model", o.model},
                                {"n_ctx", n_ctx},
                                {"n_chunk", h.n_chunk},
                                {"scored_tokens", h.n_chunk * rows},
                                {"ubatch", o.ubatch},
                                {"threads", o.threads},
                                {"kv_bytes_per_token", resident_per_token},
                                {"kv_max_resident_bytes", max_resident},
                                {"seconds", seconds},
                                {"refs", nlohmann::ordered_json::object()}};
  std::printf("%-22s KV %8.1f B/token", label.c_str(), resident_per_token);
  for (std::size_t k = 0; k < stats.size(); ++k) {
    const KldStats& s = stats[k];
    out["refs"][names[k]] = {{"mean_kld", s.mean_kld()},   {"max_kld", s.max_kld},
                             {"mean_nll", s.mean_nll()},   {"ppl", std::exp(s.mean_nll())},
                             {"mean_nll_base", s.mean_nll_base()}, {"ppl_base", std::exp(s.mean_nll_base())},
                             {"same_top", s.same_top_fraction()}};
    std::printf("  | vs %s: KL %.6f, top-1 %.2f%%, PPL %.4f (ref %.4f)", names[k].c_str(), s.mean_kld(),
                100 * s.same_top_fraction(), std::exp(s.mean_nll()), std::exp(s.mean_nll_base()));
  }
  std::printf("\n");
  if (!o.json.empty()) write_json_output(o.json, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace), "--json");
  return 0;
}

const CommandRegistrar registrar(
    "bench kld", "llama-perplexity's KL-divergence protocol through a kvslim cache, against its logits files",
    [](CLI::App& app) {
      auto o = std::make_shared<Options>();
      app.add_option("--model", o->model, "model directory or .gguf file")->required();
      app.add_option("--ref", o->refs, "NAME=FILE: a --kl-divergence-base file to compare with (repeatable; the first gives the tokens)");
      app.add_option("--text", o->text, "instead of --ref: tokenize this text into chunks (with --write-base)");
      app.add_option("--ctx", o->ctx, "with --text: tokens per chunk")->capture_default_str()->check(CLI::Range(4, 1 << 24));
      app.add_option("--chunks", o->chunks, "with --text: chunks at most")->capture_default_str()->check(CLI::Range(1, 1 << 24));
      app.add_option("--method", o->method, "KV cache method")->capture_default_str()->check(CLI::IsMember(method_names()));
      app.add_option("--set", o->sets, "cache option key=value (repeatable)");
      app.add_option("--label", o->label, "name of this point in the output (default: the method)");
      app.add_option("--ubatch", o->ubatch, "prefill micro-batch (llama.cpp's n_ubatch)")->capture_default_str()->check(CLI::Range(1, 1 << 20));
      app.add_option("--threads", o->threads, "engine threads")->capture_default_str()->check(CLI::Range(1, 256));
      app.add_option("--write-base", o->write_base, "also write this run's log-probabilities in the same format");
      app.add_option("--json", o->json, "write the figures to this JSON file");
      return [o] { return run(*o); };
    });

}  // namespace
}  // namespace kvslim::cli
