// The H2O per-token update against the fp16 attention pass over the same kept keys.
//
//   build/bin/h2o_bench
//
// BM_H2OUpdate: one decode token into a full h2o cache of `kept` rows (score against every kept
// key, softmax, pick the victim, overwrite its slot). BM_AttentionPass: what a decode step's
// attention does over the same rows (q.K, softmax, weights.V). Scoring IS such a pass (without
// the values), so the target is update <= 2x attention. The program prints that ratio per size.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels.h"
#include "kvslim/kvslim.h"

namespace {

using namespace kvslim;

std::vector<std::uint16_t> random_fp16(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = f32_to_fp16(dist(rng));
  return v;
}

void BM_H2OUpdate(benchmark::State& state) {
  const std::size_t kept = static_cast<std::size_t>(state.range(0)), D = static_cast<std::size_t>(state.range(1));
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = static_cast<int>(kept);
  c.h2o_n_sink = 4;
  c.evict_profile = "original";  // the key-proxy update is what this measures
  c.evict_recent_window = 8;  // so newcomers replace old rows instead of being dropped at once
  auto cache = KVCacheFactory::create(c);
  const auto prefill = random_fp16(kept * D, 1);
  cache->update_and_fetch(make_block_fp16(prefill.data(), 1, 1, kept, D), make_block_fp16(prefill.data(), 1, 1, kept, D));
  const std::size_t kTokens = 256;
  const auto tokens = random_fp16(kTokens * D, 2);
  std::size_t i = 0;
  for (auto _ : state) {
    const std::uint16_t* t = tokens.data() + (i++ % kTokens) * D;
    benchmark::DoNotOptimize(cache->update_and_fetch(make_block_fp16(t, 1, 1, 1, D), make_block_fp16(t, 1, 1, 1, D)));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kept * D * 2));  // keys read
}

void BM_AttentionPass(benchmark::State& state) {
  const std::size_t kept = static_cast<std::size_t>(state.range(0)), D = static_cast<std::size_t>(state.range(1));
  const auto keys = random_fp16(kept * D, 1), values = random_fp16(kept * D, 3);
  std::vector<float> q(D, 0.1f), logits(kept), probs(kept), out(D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (auto _ : state) {
    dot_fp16_rows(keys.data(), kept, D, D, q.data(), logits.data());
    std::fill(probs.begin(), probs.end(), 0.0f);
    kernels::softmax_accumulate(logits.data(), kept, scale, probs.data());
    std::fill(out.begin(), out.end(), 0.0f);
    for (std::size_t r = 0; r < kept; ++r) axpy_fp16_row(probs[r], values.data() + r * D, D, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kept * D * 2 * 2));  // keys + values read
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int D : {64, 128}) {
    for (int kept = 64; kept <= 4096; kept *= 4) b->Args({kept, D});
  }
}
BENCHMARK(BM_H2OUpdate)->Apply(sizes);
BENCHMARK(BM_AttentionPass)->Apply(sizes);

// Collects each run's time so the ratio table can be printed after the normal report.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> ns;  // "kept/D" -> time per iteration, per benchmark family
  std::map<std::string, double> attention_ns;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const std::string name = r.benchmark_name();
      const auto slash = name.find('/');
      const std::string args = name.substr(slash + 1);
      (name.rfind("BM_H2OUpdate", 0) == 0 ? ns : attention_ns)[args] = r.GetAdjustedCPUTime();
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\nH2O update / fp16 attention pass over the same kept keys (target <= 2.0), SIMD %s\n", simd_target_name());
  std::printf("%-12s %12s %12s %8s\n", "kept/D", "update ns", "attention ns", "ratio");
  for (const auto& [args, t] : reporter.ns) {
    const auto it = reporter.attention_ns.find(args);
    if (it == reporter.attention_ns.end()) continue;
    std::printf("%-12s %12.0f %12.0f %8.2f\n", args.c_str(), t, it->second, t / it->second);
  }
  benchmark::Shutdown();
  return 0;
}
