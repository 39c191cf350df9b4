// `kvslim bench engine`: the engine's prefill and decode throughput at several context lengths with
// the full cache and compressed ones, and the decode gemv's bandwidth against memcpy measured by
// the same run (decode reads every weight once per token, so it is bound by memory bandwidth).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/heap_mode.h"
#include "cli/option_checks.h"
#include "engine/model.h"
#include "engine/ops.h"
#include "engine/quant_gemv.h"
#include "engine/sampler.h"
#include "engine/tee_cache.h"
#include "kvslim/convert.h"
#include "kvslim/factory.h"
#include "kvslim/methods.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, json;
  std::vector<std::size_t> contexts{128, 512, 1024};
  std::vector<std::string> methods{"full", "h2o"};
  std::vector<std::string> sets{"h2o_budget=128", "evict_recent_window=32"};
  int decode_tokens = 32, threads = 2, repeats = 3;
  std::string heap = "warm";
  int prefill_threads = 0;  // 0: threads
  bool allow_long_context = false, shared_prefill = false;
};

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// `method` is a method spec (kvslim/methods.h), a method or an eval variant (kivi4, squeeze_s1)
// optionally followed by its own options: "kivi@kivi_bits=4,kivi_group_size=64" (applied after the
// --set options, which apply to every method).
KVCacheConfig cache_config(const std::string& method, const std::vector<std::string>& sets) {
  KVCacheConfig base;
  for (const std::string& kv : sets) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument("option '" + kv + "': expected key=value");
    base.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return config_from_spec(method, base);
}

// Best of `repeats`: GB/s of gemv over every decode matrix, and of memcpy over as many bytes.
std::pair<double, double> bandwidth(const Model& model, ThreadPool& pool, int repeats) {
  const ModelWeights& w = model.weights();
  std::vector<const Matrix*> mats;
  std::size_t max_dim = w.lm_head.rows;
  for (const LayerWeights& L : w.layers) {
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      mats.push_back(m);
      max_dim = std::max({max_dim, m->rows, m->cols});
    }
  }
  mats.push_back(&w.lm_head);
  std::vector<float> x(max_dim, 0.5f), y(max_dim);
  const double bytes = static_cast<double>(model.decode_weight_bytes());
  double best_gemv = 0;
  for (int r = 0; r < repeats + 1; ++r) {  // the first pass faults the mmap'ed pages in
    const auto t0 = Clock::now();
    for (const Matrix* m : mats) gemv(*m, x.data(), y.data(), &pool);
    if (r > 0) best_gemv = std::max(best_gemv, bytes / seconds(t0) / 1e9);
  }
  const std::size_t n = std::max<std::size_t>(model.decode_weight_bytes(), 64u << 20);
  std::vector<char> src(n, 1), dst(n, 0);
  double best_copy = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), n);
    if (r > 0) best_copy = std::max(best_copy, static_cast<double>(n) / seconds(t0) / 1e9);
  }
  if (dst[n / 2] != 1) throw std::logic_error("memcpy check failed");
  return {best_gemv, best_copy};
}

int run(const Options& o) {
  check_outputs({{o.json, "--json"}}, model_inputs(o.model));
  configure_heap(o.heap);
  std::vector<KVCacheConfig> configs;  // checked before the model loads
  for (const std::string& method : o.methods) configs.push_back(cache_config(method, o.sets));
  const Model model = Model::load(o.model);
  const ModelConfig& c = model.config();
  // Every context before the first run: a late refusal used to lose the runs already measured
  // and the --json (issue 26).
  for (std::size_t ctx : o.contexts) {
    const std::size_t need = ctx + static_cast<std::size_t>(o.decode_tokens);
    if (!o.allow_long_context && need > static_cast<std::size_t>(c.max_position_embeddings)) {
      throw std::invalid_argument("--context " + std::to_string(ctx) + ": with " + std::to_string(o.decode_tokens) +
                                  " decode steps (--decode-tokens) it needs " + std::to_string(need) +
                                  " positions, past the model's max_position_embeddings " +
                                  std::to_string(c.max_position_embeddings) + " (--allow-long-context runs it anyway)");
    }
  }
  ThreadPool pool(o.threads);
  const auto [gemv_gbs, copy_gbs] = bandwidth(model, pool, o.repeats);
  std::printf("model %s: %d layers, hidden %d, %.1f M parameters, %.1f MB read per decode step\n", o.model.c_str(),
              c.num_layers, c.hidden_size, model.parameter_count() / 1e6, model.decode_weight_bytes() / 1e6);
  const bool block_weights = is_block_type(model.weights().layers.at(0).w_up.type);
  const std::string gemv_kernels = block_weights ? std::string(weight_type_name(model.weights().layers[0].w_up.type)) +
                                                       " int8 blocks, " + qgemv::target_name()
                                                 : std::string(gemv_target_name());
  std::printf("gemv (%s, %d threads): %.2f GB/s of weights; memcpy: %.2f GB/s copied; ratio %.2f\n",
              gemv_kernels.c_str(), o.threads, gemv_gbs, copy_gbs, gemv_gbs / copy_gbs);
  // Prefill's products run on OpenBLAS's kernels, which it picks at load time (OPENBLAS_CORETYPE
  // overrides): their instruction set moves prefill speed by about 1.5x on an AVX-512 machine.
  const char* blas_core = openblas_get_corename();
  std::printf("prefill sgemm: OpenBLAS %s kernels, single-threaded under the engine's %d-thread pool\n",
              blas_core != nullptr ? blas_core : "?", o.threads);
  std::printf("heap: %s; kivi / zipcache codes read by: %s\n", heap_description(o.heap), attend_packed_kernels());
  nlohmann::ordered_json out = {{"model", o.model},
                                {"gemv_target", gemv_kernels},
                                {"blas_core", openblas_get_corename() != nullptr ? openblas_get_corename() : "?"},
                                {"threads", o.threads},
                                {"heap", o.heap},
                                {"attend_packed_kernels", attend_packed_kernels()},
                                {"decode_weight_bytes", model.decode_weight_bytes()},
                                {"gemv_gb_per_s", gemv_gbs},
                                {"memcpy_gb_per_s", copy_gbs},
                                {"runs", nlohmann::ordered_json::array()}};

  std::printf("%-18s %8s %14s %14s %16s %16s\n", "method", "context", "prefill tok/s", "decode tok/s", "KV resident B",
              "KV fp16 equiv B");
  const int prefill_threads = o.prefill_threads > 0 ? o.prefill_threads : o.threads;
  if (prefill_threads != o.threads) std::printf("(prefill on %d threads, decode on %d)\n", prefill_threads, o.threads);

  struct Point {
    double prefill = 0, decode = 0;
    std::size_t resident = 0, fp16 = 0;
  };
  // Caches for `methods` (indices into o.methods) filled by one prefill of `prompt` -- the first
  // method's cache answers the prefill's attention, the others absorb the same stream
  // (engine/tee_cache.h) -- then each decoded alone, timed; one Point per method.
  auto run_once = [&](const std::vector<std::size_t>& methods, const std::vector<int>& prompt) {
    const std::size_t ctx = prompt.size();
    std::vector<CacheSet> sets;
    for (std::size_t m : methods) {
      sets.push_back(KVCacheBuilder::for_model(model.cache_spec(), configs[m]));
      // The run's length is known: a full cache allocates for it once, as llama.cpp's n_ctx
      // cache does (growing x1.5 at a decode step would time one copy of the whole store).
      sets.back().reserve(ctx + static_cast<std::size_t>(o.decode_tokens));
    }
    std::vector<const CacheSet*> followers;
    for (std::size_t i = 1; i < sets.size(); ++i) followers.push_back(&sets[i]);
    CacheSet tee = followers.empty() ? CacheSet{} : tee_cache_set(sets[0], followers);
    CacheSet& prefill_set = followers.empty() ? sets[0] : tee;
    int first_token = 0;
    double prefill_rate = 0;
    {
      Transformer t(model, prefill_set, {.threads = prefill_threads, .max_chunk = ctx, .max_context = ctx,
                                         .allow_past_max_positions = o.allow_long_context});
      const auto t0 = Clock::now();
      first_token = argmax(t.prefill(prompt));
      prefill_rate = ctx / seconds(t0);
    }
    std::vector<Point> points;
    for (CacheSet& caches : sets) {
      Transformer t(model, caches, {.threads = o.threads, .max_chunk = 1, .max_context = ctx + o.decode_tokens,
                                    .allow_past_max_positions = o.allow_long_context});
      const std::int64_t next = static_cast<std::int64_t>(ctx);
      const auto t0 = Clock::now();
      int token = argmax(t.forward(std::span<const int>(&first_token, 1), std::span<const std::int64_t>(&next, 1)));
      for (int i = 1; i < o.decode_tokens; ++i) token = argmax(t.decode(token));
      points.push_back({prefill_rate, o.decode_tokens / seconds(t0), caches.resident_bytes(), caches.seen_fp16_bytes()});
    }
    return points;
  };

  auto report = [&](std::size_t m, std::size_t ctx, const Point& p) {
    const std::string& method = o.methods[m];
    std::printf("%-18s %8zu %14.1f %14.1f %16zu %16zu\n", method.c_str(), ctx, p.prefill, p.decode, p.resident, p.fp16);
    std::fflush(stdout);
    out["runs"].push_back({{"method", method}, {"context", ctx}, {"decode_tokens", o.decode_tokens},
                           {"prefill_tokens_per_s", p.prefill}, {"decode_tokens_per_s", p.decode},
                           {"kv_resident_bytes", p.resident}, {"kv_fp16_equivalent_bytes", p.fp16},
                           {"prefill_shared_with", o.shared_prefill ? o.methods.front() : method}});
  };
  auto best = [](Point& b, const Point& p) {
    b.prefill = std::max(b.prefill, p.prefill);
    b.decode = std::max(b.decode, p.decode);
    b.resident = p.resident;
    b.fp16 = p.fp16;
  };
  for (std::size_t ctx : o.contexts) {
    std::vector<int> prompt(ctx);
    for (std::size_t i = 0; i < ctx; ++i) prompt[i] = static_cast<int>((i * 7919 + 13) % c.vocab_size);
    if (o.shared_prefill) {
      std::vector<std::size_t> all(o.methods.size());
      for (std::size_t m = 0; m < all.size(); ++m) all[m] = m;
      std::vector<Point> b(all.size());
      for (int r = 0; r < o.repeats; ++r) {
        const std::vector<Point> p = run_once(all, prompt);
        for (std::size_t m = 0; m < all.size(); ++m) best(b[m], p[m]);
      }
      for (std::size_t m = 0; m < all.size(); ++m) report(m, ctx, b[m]);
    } else {
      for (std::size_t m = 0; m < o.methods.size(); ++m) {
        Point b;
        for (int r = 0; r < o.repeats; ++r) best(b, run_once({m}, prompt).front());
        report(m, ctx, b);
      }
    }
  }
  if (!o.json.empty()) {
    write_json_output(o.json, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace), "--json");
  }
  return 0;
}

const CommandRegistrar registrar("bench engine", "engine prefill/decode tokens/s per method and context; gemv vs memcpy GB/s",
                                 [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "model directory (see `kvslim random-model`)")->required();
  app.add_option("--context", o->contexts, "prompt lengths")->capture_default_str()->check(CLI::Range(1, 1 << 26));
  app.add_option("--method", o->methods, "KV cache methods or eval variants (kvslim eval --list-methods: kivi4, h2o+kivi3_g64...); "
                 "name@key=value,... gives one its own options (kivi@kivi_bits=4)")
      ->capture_default_str();
  app.add_option("--set", o->sets, "cache options key=value, applied to every method")->capture_default_str();
  app.add_option("--decode-tokens", o->decode_tokens, "decode steps timed per run")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--threads", o->threads, "decode threads")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--prefill-threads", o->prefill_threads, "prefill threads (default: --threads)")->check(CLI::Range(1, 256));
  app.add_flag("--shared-prefill", o->shared_prefill,
               "one prefill per context fills every method's cache (the first method's cache answers its attention; "
               "engine/tee_cache.h), then each decodes alone: a long context costs one prefill, not one per method");
  app.add_option("--repeats", o->repeats, "runs per point (best reported)")->capture_default_str()->check(CLI::Range(1, 100));
  app.add_option("--json", o->json, "also write the figures to this JSON file");
  add_heap_option(app, o->heap);
  app.add_flag("--allow-long-context", o->allow_long_context,
               "run contexts past the model's max_position_embeddings (refused by default)");
  return [o] { return run(*o); };
});

}  // namespace
}  // namespace kvslim::cli
