// Per-kernel costs of decode attention over one block of packed codes: one KV head, 4 query heads,
// 1024 rows in groups of 32, cache-resident -- the compute side of `kvslim bench attend`, split by
// kernel (keys: query split + integer dot products; values: probability split + integer dot
// products; the softmax exp), beside the fp16 kernels over the same rows.
//
//   build/bin/attend_bench --benchmark_counters_tabular=true
//
// Counter per_group: time per 32-row group (the unit the integer kernels work in).
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "attend/attend_kernels.h"
#include "kvslim/dtype.h"
#include "kvslim/zipcache.h"

namespace {

using namespace kvslim;

constexpr std::size_t kRows = 1024, kQueries = 4, kGroup = 32, kGroups = kRows / kGroup;

std::vector<float> normal(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void per_group(benchmark::State& state) {
  state.counters["per_group"] = benchmark::Counter(static_cast<double>(kGroups),
                                                      benchmark::Counter::kIsIterationInvariantRate |
                                                          benchmark::Counter::kInvert);
}

bool skip_without_int8(benchmark::State& state, std::size_t D, int bits) {
  if (attend::packed_int8_supported(D, bits)) return false;
  state.SkipWithError("the integer kernels do not run here (AVX-512 VNNI + VBMI, 16/32/64-byte rows)");
  return true;
}

// Scores of the 4 queries against the block's packed keys (the query split per group included).
void BM_KeysInt8(benchmark::State& state) {
  const auto D = static_cast<std::size_t>(state.range(0));
  const int bits = static_cast<int>(state.range(1));
  if (skip_without_int8(state, D, bits)) return;
  const GroupQuantized keys = quantize_groups(normal(kRows * D, 1), kRows, D, bits, kGroup);
  const auto q = normal(kQueries * D, 2, 1.0f / std::sqrt(static_cast<float>(D)));
  std::vector<float> logits(kQueries * kRows);
  for (auto _ : state) {
    attend::logits_packed_int8(q.data(), keys.scale.data(), keys.zero.data(), kGroup, kQueries, D, keys.codes.data(),
                               bits, kRows, logits.data(), kRows);
    benchmark::DoNotOptimize(logits.data());
  }
  per_group(state);
}
BENCHMARK(BM_KeysInt8)->ArgsProduct({{64, 128}, {2, 4}});

// Weighted sum of the block's packed values (the probability split per group included).
void BM_ValuesInt8(benchmark::State& state) {
  const auto D = static_cast<std::size_t>(state.range(0));
  const int bits = static_cast<int>(state.range(1));
  if (skip_without_int8(state, D, bits)) return;
  const GroupQuantized values = quantize_groups(normal(kRows * D, 3), kRows, D, bits, kGroup);
  auto p = normal(kQueries * kRows, 4);
  for (auto& x : p) x = std::exp(-std::fabs(x) * 4.0f);  // softmax weights in (0, 1]
  std::vector<float> acc(kQueries * D);
  for (auto _ : state) {
    attend::accumulate_packed_int8(p.data(), kRows, kQueries, values.codes.data(), bits, kRows, D, kGroup,
                                   values.scale.data(), values.zero.data(), acc.data());
    benchmark::DoNotOptimize(acc.data());
  }
  per_group(state);
}
BENCHMARK(BM_ValuesInt8)->ArgsProduct({{64, 128}, {2, 4}});

// The softmax weights of the 4 queries over the block.
void BM_ExpShift(benchmark::State& state) {
  const auto scores = normal(kQueries * kRows, 5, 3.0f);
  std::vector<float> w(scores.size());
  for (auto _ : state) {
    w = scores;
    for (std::size_t m = 0; m < kQueries; ++m) benchmark::DoNotOptimize(attend::exp_shift(w.data() + m * kRows, kRows, 10.0f));
  }
  per_group(state);
}
BENCHMARK(BM_ExpShift);

// The fp16 kernels over the same number of rows (what full / h2o / the staging window run).
void BM_Fp16Rows(benchmark::State& state) {
  const auto D = static_cast<std::size_t>(state.range(0));
  std::vector<std::uint16_t> keys(kRows * D), values(kRows * D);
  const auto k = normal(kRows * D, 6), v = normal(kRows * D, 7);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = f32_to_fp16(k[i]);
    values[i] = f32_to_fp16(v[i]);
  }
  const auto q = normal(kQueries * D, 8, 1.0f / std::sqrt(static_cast<float>(D)));
  std::vector<float> scores(kQueries * kRows), acc(kQueries * D);
  for (auto _ : state) {
    attend::logits_f16(q.data(), kQueries, D, keys.data(), D, kRows, scores.data(), kRows);
    attend::accumulate_f16(scores.data(), kRows, kQueries, values.data(), D, kRows, D, acc.data());
    benchmark::DoNotOptimize(acc.data());
  }
  per_group(state);
}
BENCHMARK(BM_Fp16Rows)->Arg(64)->Arg(128);

}  // namespace

BENCHMARK_MAIN();
