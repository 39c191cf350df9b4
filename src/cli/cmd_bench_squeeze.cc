// `kvslim bench squeeze`: the original benchmark_squeeze.py sweep on the same workload, with the
// original's committed figures printed beside kvslim's.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <sys/mman.h>
#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/heap_mode.h"
#include "cli/option_checks.h"
#include "kvslim/kvslim.h"

namespace kvslim::cli {
namespace {

constexpr std::size_t kHeads = 8, kHeadDim = 128;
constexpr int kSink = 4;

// The original's committed results (figures/squeeze/results.json, Apple Silicon, pure Python).
struct Original {
  int budget_first, budget_last;
  double budget_mean;
  int kept_first, kept_last;
  double ratio, seconds;
};
using Key = std::tuple<int, int, int, int>;  // n_layers, seq_len, avg_budget, strength x 10
const std::map<Key, Original>& original_results() {
  static const std::map<Key, Original> table = {
      {{12, 256, 64, 0}, {64, 64, 64.0, 64, 64, 4.016, 67.0}},
      {{12, 256, 64, 5}, {140, 32, 64.1, 65, 32, 5.382, 66.5}},
      {{12, 256, 64, 10}, {215, 5, 65.2, 65, 5, 8.010, 41.0}},
      {{12, 256, 128, 0}, {128, 128, 128.0, 128, 128, 2.008, 32.5}},
      {{12, 256, 128, 5}, {279, 64, 127.8, 129, 64, 2.712, 37.8}},
      {{12, 256, 128, 10}, {431, 5, 129.1, 129, 5, 4.101, 44.3}},
      {{12, 512, 64, 0}, {64, 64, 64.0, 64, 64, 8.016, 141.8}},
      {{12, 512, 64, 5}, {140, 32, 64.1, 65, 32, 10.743, 199.0}},
      {{12, 512, 64, 10}, {215, 5, 65.2, 65, 5, 15.990, 149.5}},
      {{12, 512, 128, 0}, {128, 128, 128.0, 128, 128, 4.008, 123.3}},
      {{12, 512, 128, 5}, {279, 64, 127.8, 129, 64, 5.414, 98.1}},
      {{12, 512, 128, 10}, {431, 5, 129.1, 129, 5, 8.186, 116.6}},
      {{32, 256, 64, 0}, {64, 64, 64.0, 64, 64, 4.016, 182.8}},
      {{32, 256, 64, 5}, {144, 32, 64.0, 65, 32, 5.372, 139.9}},
      {{32, 256, 64, 10}, {224, 5, 65.1, 65, 5, 7.938, 109.9}},
      {{32, 256, 128, 0}, {128, 128, 128.0, 128, 128, 2.008, 92.8}},
      {{32, 256, 128, 5}, {288, 64, 127.9, 129, 64, 2.700, 103.7}},
      {{32, 256, 128, 10}, {448, 5, 128.9, 129, 5, 4.069, 101.2}},
      {{32, 512, 64, 0}, {64, 64, 64.0, 64, 64, 8.016, 265.5}},
      {{32, 512, 64, 5}, {144, 32, 64.0, 65, 32, 10.729, 288.8}},
      {{32, 512, 64, 10}, {224, 5, 65.1, 65, 5, 15.83, 289.5}},
      {{32, 512, 128, 0}, {128, 128, 128.0, 128, 128, 4.008, 260.4}},
      {{32, 512, 128, 5}, {288, 64, 127.9, 129, 64, 5.388, 260.9}},
      {{32, 512, 128, 10}, {448, 5, 128.9, 129, 5, 8.131, 269.4}},
  };
  return table;
}

// The original workload: layer li of L has keys (1 - f) N(0,1) + 3 f with f = li / (L - 1) and
// values N(0,1), [1, 8, S, 128] as fp16; one decode token per layer from a fixed seed.
struct Workload {
  std::vector<std::vector<std::uint16_t>> keys, values;  // per layer: fp16 [1, 8, S, 128]
  std::vector<std::uint16_t> decode_key, decode_value;   // fp16 [1, 8, 1, 128]
};

std::vector<std::uint16_t> normal_fp16(std::size_t n, std::mt19937& rng, float scale, float shift) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::uint16_t> out(n);
  for (auto& h : out) h = f32_to_fp16(scale * dist(rng) + shift);
  return out;
}

Workload make_workload(int L, std::size_t S) {
  Workload w;
  const std::size_t n = kHeads * S * kHeadDim;
  for (int li = 0; li < L; ++li) {
    std::mt19937 rng(static_cast<unsigned>(li));
    const float f = static_cast<float>(li) / static_cast<float>(std::max(L - 1, 1));
    w.keys.push_back(normal_fp16(n, rng, 1.0f - f, 3.0f * f));
    w.values.push_back(normal_fp16(n, rng, 1.0f, 0.0f));
  }
  std::mt19937 rng(777);
  w.decode_key = normal_fp16(kHeads * kHeadDim, rng, 1.0f, 0.0f);
  w.decode_value = normal_fp16(kHeads * kHeadDim, rng, 1.0f, 0.0f);
  return w;
}

struct Result {
  int n_layers, seq_len, avg_budget;
  double strength;
  std::string prefill;
  double conc_first = 0, conc_last = 0;
  int budget_first = 0, budget_last = 0;
  double budget_mean = 0;
  int kept_first = 0, kept_last = 0;
  double compression_ratio = 0;  // the original's: L (S + 1) / sum of kept tokens
  double resident_ratio = 0;     // kvslim's: fp16 bytes of every token seen / resident bytes
  double latency_ms = 0;         // median over runs: prefill every layer + one decode step
  long page_faults = 0;          // minor page faults of the timed region (median over runs)
};

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// What a first touch of memory the process never wrote costs on this machine: 32 MiB mapped
// fresh and written, then written again. On virtual machines whose host backs guest memory
// lazily the first pass can cost microseconds per page, and every cache store's new pages pay it.
struct FirstTouch {
  double fresh_us_per_page = 0, rewrite_us_per_page = 0;
};
FirstTouch probe_first_touch() {
  constexpr std::size_t kBytes = std::size_t{32} << 20, kPage = 4096;
  void* m = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return {};
  auto* p = static_cast<volatile char*>(m);
  auto pass = [&](char value) {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < kBytes; i += kPage) p[i] = value;
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / (kBytes / kPage);
  };
  FirstTouch f;
  f.fresh_us_per_page = pass(1);
  f.rewrite_us_per_page = pass(2);
  munmap(m, kBytes);
  return f;
}

// One pass of the original timed region; fills the figures when `r` is given.
struct Timed {
  double ms;
  long faults;
};

Timed run_once(const Workload& w, int L, std::size_t S, int avg, double strength, const std::string& prefill, Result* r) {
  KVCacheConfig c;
  c.method = "squeeze";
  c.squeeze_budget = avg;
  c.squeeze_n_sink = kSink;
  c.squeeze_strength = strength;
  c.squeeze_prefill = prefill;
  c.evict_profile = "original";  // the original's H2O core: the figures it published
  // The documented order is reproduced with the documented measure too (batch 0, head 0 only);
  // kvslim's default averages the concentration over every head.
  c.squeeze_concentration_heads = prefill == "eager" ? "first" : "all";
  CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(L, kHeads, kHeadDim), c);
  const long faults0 = minor_faults();
  const auto t0 = std::chrono::steady_clock::now();
  for (int li = 0; li < L; ++li) {
    set.at(li).update_and_fetch(make_block_fp16(w.keys[li].data(), 1, kHeads, S, kHeadDim),
                                make_block_fp16(w.values[li].data(), 1, kHeads, S, kHeadDim));
  }
  for (int li = 0; li < L; ++li) {
    set.at(li).update_and_fetch(make_block_fp16(w.decode_key.data(), 1, kHeads, 1, kHeadDim),
                                make_block_fp16(w.decode_value.data(), 1, kHeads, 1, kHeadDim));
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const long faults = minor_faults() - faults0;
  if (r != nullptr) {
    double budget_sum = 0, kept_sum = 0;
    for (int li = 0; li < L; ++li) {
      const CacheStats st = set.at(li).stats();
      for (std::size_t k : st.kept_per_head) {
        if (k != st.tokens_kept) throw std::logic_error("bench squeeze: heads of layer " + std::to_string(li) + " disagree on kept tokens");
      }
      budget_sum += st.figure("layer_budget");
      kept_sum += static_cast<double>(st.tokens_kept);
    }
    const CacheStats first = set.at(0).stats(), last = set.at(L - 1).stats();
    r->conc_first = first.figure("concentration");
    r->conc_last = last.figure("concentration");
    r->budget_first = static_cast<int>(first.figure("layer_budget"));
    r->budget_last = static_cast<int>(last.figure("layer_budget"));
    r->budget_mean = budget_sum / L;
    r->kept_first = static_cast<int>(first.tokens_kept);
    r->kept_last = static_cast<int>(last.tokens_kept);
    r->compression_ratio = static_cast<double>(L) * static_cast<double>(S + 1) / kept_sum;
    r->resident_ratio = static_cast<double>(set.seen_fp16_bytes()) / static_cast<double>(set.resident_bytes());
  }
  return {ms, faults};
}

int run_bench(const std::vector<int>& layers, const std::vector<int>& seqs, const std::vector<int>& avgs,
              const std::vector<double>& strengths, const std::vector<std::string>& prefills, int repeats,
              const std::string& heap, const std::string& json_path) {
  if (!json_path.empty()) check_output_path(json_path, "--json");
  // A sweep with nothing to run is an error, not an empty table and exit 0.
  if (std::none_of(seqs.begin(), seqs.end(), [&](int S) { return std::any_of(avgs.begin(), avgs.end(), [&](int a) { return a <= S; }); })) {
    throw std::invalid_argument("--seq/--avg: no configuration to run, every --avg exceeds every --seq (the original skips avg > seq)");
  }
  configure_heap(heap);
  std::vector<Result> results;
  std::printf("kvslim bench squeeze: %zu heads x head_dim %zu, n_sink %d, batch 1; SIMD %s; latency = median of %d runs\n",
              kHeads, kHeadDim, kSink, simd_target_name(), repeats);
  const FirstTouch touch = probe_first_touch();
  std::printf("first touch of fresh memory on this machine: %.2f us per 4 KiB page (writing it again: %.3f); "
              "faults = the timed region's minor page faults\n",
              touch.fresh_us_per_page, touch.rewrite_us_per_page);
  std::printf("heap: %s%s\n", heap_description(heap), heap == "warm" ? "; one untimed run per config first" : "");
  std::printf("%-3s %-4s %-4s %-4s %-8s | %-12s %-7s %-9s %-7s %-7s %-9s %-7s | %-7s %-9s %-7s %-8s %-8s\n", "L", "S", "avg",
              "str", "prefill", "conc f/l", "b f/l", "b mean", "kept", "ratio", "ms", "faults", "orig b", "orig kept", "ratio",
              "orig s", "speedup");
  for (int L : layers) {
    for (int S : seqs) {
      const Workload w = make_workload(L, static_cast<std::size_t>(S));
      for (int avg : avgs) {
        if (avg > S) continue;  // the original skips these
        for (double strength : strengths) {
          for (const auto& prefill : prefills) {
            Result r{L, S, avg, strength, prefill};
            std::vector<double> times;
            std::vector<long> faults;
            if (heap == "warm") run_once(w, L, static_cast<std::size_t>(S), avg, strength, prefill, nullptr);
            for (int i = 0; i < repeats; ++i) {
              const Timed t = run_once(w, L, static_cast<std::size_t>(S), avg, strength, prefill, i == 0 ? &r : nullptr);
              times.push_back(t.ms);
              faults.push_back(t.faults);
            }
            std::sort(times.begin(), times.end());
            std::sort(faults.begin(), faults.end());
            r.latency_ms = times[times.size() / 2];
            r.page_faults = faults[faults.size() / 2];
            const auto it = original_results().find({L, S, avg, static_cast<int>(std::lround(strength * 10))});
            char orig_b[32] = "-", orig_k[32] = "-", orig_ratio[32] = "-", orig_s[32] = "-", speed[32] = "-";
            if (it != original_results().end()) {
              const Original& o = it->second;
              std::snprintf(orig_b, sizeof orig_b, "%d/%d", o.budget_first, o.budget_last);
              std::snprintf(orig_k, sizeof orig_k, "%d/%d", o.kept_first, o.kept_last);
              std::snprintf(orig_ratio, sizeof orig_ratio, "%.3f", o.ratio);
              std::snprintf(orig_s, sizeof orig_s, "%.1f", o.seconds);
              std::snprintf(speed, sizeof speed, "%.0fx", o.seconds * 1000.0 / r.latency_ms);
            }
            char conc[32], budgets[32], kept[32];
            std::snprintf(conc, sizeof conc, "%.3f/%.3f", r.conc_first, r.conc_last);
            std::snprintf(budgets, sizeof budgets, "%d/%d", r.budget_first, r.budget_last);
            std::snprintf(kept, sizeof kept, "%d/%d", r.kept_first, r.kept_last);
            std::printf("%-3d %-4d %-4d %-4.1f %-8s | %-12s %-7s %-9.1f %-7s %-7.3f %-9.2f %-7ld | %-7s %-9s %-7s %-8s %-8s\n", L, S,
                        avg, strength, prefill.c_str(), conc, budgets, r.budget_mean, kept, r.compression_ratio, r.latency_ms,
                        r.page_faults, orig_b,
                        orig_k, orig_ratio, orig_s, speed);
            std::fflush(stdout);
            results.push_back(r);
          }
        }
      }
    }
  }
  if (!json_path.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const Result& r : results) {
      out.push_back({{"n_layers", r.n_layers},       {"seq_len", r.seq_len},          {"avg_budget", r.avg_budget},
                     {"strength", r.strength},       {"prefill", r.prefill},          {"conc_first", r.conc_first},
                     {"conc_last", r.conc_last},     {"budget_first", r.budget_first}, {"budget_last", r.budget_last},
                     {"budget_mean", r.budget_mean}, {"kept_first", r.kept_first},    {"kept_last", r.kept_last},
                     {"compression_ratio", r.compression_ratio}, {"resident_ratio", r.resident_ratio},
                     {"latency_ms", r.latency_ms}, {"page_faults", r.page_faults}});
    }
    write_json_output(json_path, out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace), "--json");
    std::printf("wrote %s (%zu configs)\n", json_path.c_str(), results.size());
  }
  return 0;
}

struct Options {
  std::vector<int> layers{12, 32}, seqs{256, 512}, avgs{64, 128};
  std::vector<double> strengths{0.0, 0.5, 1.0};
  std::vector<std::string> prefills{"deferred", "eager"};
  int repeats = 5;
  std::string heap = "warm", json;
};

const CommandRegistrar registrar(
    "bench squeeze", "the original squeeze benchmark sweep, original figures beside kvslim's", [](CLI::App& app) {
      auto o = std::make_shared<Options>();
      // Every numeric flag has its range (issue 26): --avg above the sinks (the budget must
      // leave room for a recent token), --seq at least one --avg (the original skips avg > seq).
      app.add_option("--layers", o->layers, "n_layers values")->capture_default_str()->check(CLI::Range(1, 4096));
      app.add_option("--seq", o->seqs, "seq_len values")->capture_default_str()->check(CLI::Range(kSink + 1, 1 << 20));
      app.add_option("--avg", o->avgs, "avg_budget values")->capture_default_str()->check(CLI::Range(kSink + 1, 1 << 20));
      app.add_option("--strength", o->strengths, "squeeze_strength values")->capture_default_str()->check(finite_range(0.0, 1.0));
      app.add_option("--prefill", o->prefills, "prefill orders: deferred (kvslim default), eager (documented)")
          ->capture_default_str()
          ->check(CLI::IsMember({"deferred", "eager"}));
      app.add_option("--repeats", o->repeats, "timed runs per config (median reported)")->capture_default_str()->check(CLI::Range(1, 1000));
      add_heap_option(app, o->heap);
      app.add_option("--json", o->json, "write one JSON object per config to this file");
      return [o] {
        return run_bench(o->layers, o->seqs, o->avgs, o->strengths, o->prefills, o->repeats, o->heap, o->json);
      };
    });

}  // namespace
}  // namespace kvslim::cli
