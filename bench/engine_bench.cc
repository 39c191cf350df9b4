// Engine kernels: the decode gemv per weight type (1 and 2 threads) against memcpy of the same
// bytes in the same run, the prefill matmul, and whole forward steps on a random model with the
// full cache and a compressed one. Decode reads every weight once per token, so gemv GB/s against
// memcpy GB/s says how close decode is to this machine's bound.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "engine/model.h"
#include "engine/ops.h"
#include "engine/quant_gemv.h"
#include "engine/random_model.h"
#include "engine/sampler.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {
namespace {

// 4096 x 4096: 32 MiB as bf16/f16, 64 MiB as f32 -- far beyond the caches, like a real layer.
constexpr std::size_t kRows = 4096, kCols = 4096;

const std::vector<std::uint8_t>& weight_bytes() {
  static const std::vector<std::uint8_t> bytes = [] {
    std::vector<std::uint8_t> b(kRows * kCols * 4);
    Rng rng(1);
    for (std::size_t i = 0; i < b.size(); i += 2) {
      // Small finite values whichever type reads them: bf16/f16 halves with a modest exponent.
      const std::uint16_t h = static_cast<std::uint16_t>(0x3000u | (rng.next() & 0x03ffu));
      std::memcpy(b.data() + i, &h, 2);
    }
    return b;
  }();
  return bytes;
}

void BM_Memcpy(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0)) << 20;
  std::vector<char> src(n, 1), dst(n, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}
BENCHMARK(BM_Memcpy)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Gemv(benchmark::State& state) {
  const auto type = static_cast<WeightType>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const Matrix w{type, weight_bytes().data(), kRows, kCols};
  std::vector<float> x(kCols, 0.25f), y(kRows);
  ThreadPool pool(threads);
  for (auto _ : state) {
    gemv(w, x.data(), y.data(), &pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * w.nbytes()));
  state.SetLabel(std::string(weight_type_name(type)) + " " + gemv_target_name());
}
BENCHMARK(BM_Gemv)
    ->ArgsProduct({{static_cast<int>(WeightType::bf16), static_cast<int>(WeightType::f16), static_cast<int>(WeightType::f32)},
                   {1, 2}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

// The same shape in a block format (random code bytes, fp16 scales that keep values small).
const std::vector<std::uint8_t>& block_bytes(WeightType type) {
  static std::map<WeightType, std::vector<std::uint8_t>> cache;
  auto& b = cache[type];
  if (b.empty() && weight_interleave_rows(type) > 1) {  // the file-type matrix repacked as the GGUF loader does
    const WeightType base = type == WeightType::q4_0x16 ? WeightType::q4_0 : type == WeightType::q4_kx16 ? WeightType::q4_k : WeightType::q6_k;
    const std::vector<std::uint8_t>& q = block_bytes(base);
    std::vector<const std::uint8_t*> rows(kRows);
    for (std::size_t r = 0; r < kRows; ++r) rows[r] = q.data() + r * (q.size() / kRows);
    b.resize(kRows * weight_bytes(type, kCols));
    qgemv::interleave(base, rows.data(), kRows, kCols, b.data());
  }
  if (b.empty()) {
    const std::size_t bb = weight_type_size(type), blocks = kRows * kCols / weight_block_elements(type);
    b.resize(blocks * bb);
    Rng rng(2);
    for (auto& byte : b) byte = static_cast<std::uint8_t>(rng.next());
    const std::uint16_t small = f32_to_fp16(0.001f);
    for (std::size_t k = 0; k < blocks; ++k) {
      std::uint8_t* blk = b.data() + k * bb;
      if (type == WeightType::q6_k) {
        std::memcpy(blk + 208, &small, 2);
      } else {
        std::memcpy(blk, &small, 2);
        if (type == WeightType::q4_k || type == WeightType::q5_k) std::memcpy(blk + 2, &small, 2);
      }
    }
  }
  return b;
}

// Decode's product over block-quantized weights (engine/quant_gemv.h): bytes are the blocks' bytes.
void BM_GemvQuant(benchmark::State& state) {
  const auto type = static_cast<WeightType>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const Matrix w{type, block_bytes(type).data(), kRows, kCols};
  std::vector<float> x(kCols), y(kRows);
  for (std::size_t i = 0; i < kCols; ++i) x[i] = static_cast<float>(i % 17) * 0.1f - 0.8f;
  ThreadPool pool(threads);
  for (auto _ : state) {
    gemv(w, x.data(), y.data(), &pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * w.nbytes()));
  state.SetLabel(std::string(weight_type_name(type)) + " " + qgemv::target_name());
}
BENCHMARK(BM_GemvQuant)
    ->ArgsProduct({{static_cast<int>(WeightType::q4_0), static_cast<int>(WeightType::q8_0), static_cast<int>(WeightType::q4_k),
                    static_cast<int>(WeightType::q5_k), static_cast<int>(WeightType::q6_k), static_cast<int>(WeightType::q4_0x16),
                    static_cast<int>(WeightType::q4_kx16), static_cast<int>(WeightType::q6_kx16)},
                   {1, 2}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

// The interleaved kernels' work per byte, with the matrix in L2 (128 x 4096: 296-420 KB): the first
// 128 rows of BM_GemvQuant's blocks, one thread, CPU time (this machine's other processes take the
// core away now and then; a descheduled stretch counts in real time only).
void BM_GemvQuantL2(benchmark::State& state) {
  const auto type = static_cast<WeightType>(state.range(0));
  const Matrix w{type, block_bytes(type).data(), 128, kCols};
  std::vector<float> x(kCols), y(128);
  for (std::size_t i = 0; i < kCols; ++i) x[i] = static_cast<float>(i % 17) * 0.1f - 0.8f;
  for (auto _ : state) {
    gemv(w, x.data(), y.data(), nullptr);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * w.nbytes()));
  state.SetLabel(std::string(weight_type_name(type)) + " " + qgemv::target_name());
}
BENCHMARK(BM_GemvQuantL2)
    ->ArgsProduct({{static_cast<int>(WeightType::q4_0x16), static_cast<int>(WeightType::q4_kx16), static_cast<int>(WeightType::q6_kx16)}})
    ->Unit(benchmark::kMicrosecond);

// Prefill's product over block-quantized weights: tiles dequantized to fp32, then sgemm.
void BM_MatmulQuant(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(1));
  const auto type = static_cast<WeightType>(state.range(0));
  const Matrix w{type, block_bytes(type).data(), 2048, 2048};
  std::vector<float> x(n * 2048, 0.25f), y(n * 2048), tile(256 * 2048);
  for (auto _ : state) {
    matmul(w, x.data(), n, y.data(), tile.data(), 256);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * n), benchmark::Counter::kIsRate);
  state.SetLabel(weight_type_name(type));
}
BENCHMARK(BM_MatmulQuant)
    ->ArgsProduct({{static_cast<int>(WeightType::q4_0), static_cast<int>(WeightType::q4_k), static_cast<int>(WeightType::q4_0x16),
                    static_cast<int>(WeightType::q4_kx16), static_cast<int>(WeightType::q6_k),
                    static_cast<int>(WeightType::q6_kx16)},
                   {16, 128}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Matmul(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  const Matrix w{WeightType::bf16, weight_bytes().data(), 2048, 2048};
  std::vector<float> x(n * 2048, 0.25f), y(n * 2048), tile(256 * 2048);
  for (auto _ : state) {
    matmul(w, x.data(), n, y.data(), tile.data(), 256);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * n), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Matmul)->Arg(16)->Arg(128)->Unit(benchmark::kMillisecond)->UseRealTime();

// A 61M-parameter bf16 model (4 layers of hidden 1024, vocab 8192), written once per process and
// run once so the timed loops never page the mmap'ed weights in.
const Model& bench_model() {
  static const Model model = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("kvslim_engine_bench_" + std::to_string(getpid()));
    write_random_model(dir, RandomModelSpec{.hidden_size = 1024, .intermediate_size = 2816, .num_layers = 4,
                                            .num_heads = 16, .num_kv_heads = 4, .head_dim = 64, .vocab_size = 8192,
                                            .dtype = WeightType::bf16},
                       /*force=*/true);
    Model m = Model::load(dir);
    std::filesystem::remove_all(dir);  // the mapping stays valid after unlink
    CacheSet caches = KVCacheBuilder::for_model(m.cache_spec(), KVCacheConfig{});
    Transformer warm(m, caches);
    const std::vector<int> prompt = {1, 2, 3, 4};
    warm.prefill(prompt);
    return m;
  }();
  return model;
}

KVCacheConfig method_config(int compressed) {
  KVCacheConfig cfg;
  if (compressed != 0) {
    cfg.method = "h2o";
    cfg.h2o_budget = 128;
    cfg.evict_recent_window = 32;
  }
  return cfg;
}

void BM_Prefill(benchmark::State& state) {
  const Model& model = bench_model();
  const std::size_t ctx = static_cast<std::size_t>(state.range(0));
  std::vector<int> prompt(ctx);
  for (std::size_t i = 0; i < ctx; ++i) prompt[i] = static_cast<int>((i * 7919) % 8192);
  for (auto _ : state) {
    CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), method_config(static_cast<int>(state.range(1))));
    Transformer t(model, caches, {.max_chunk = ctx, .max_context = ctx});
    benchmark::DoNotOptimize(t.prefill(prompt).data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * ctx), benchmark::Counter::kIsRate);
  state.SetLabel(state.range(1) ? "h2o budget 128" : "full");
}
BENCHMARK(BM_Prefill)->ArgsProduct({{128, 512, 1024}, {0, 1}})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Decode(benchmark::State& state) {
  const Model& model = bench_model();
  const std::size_t ctx = static_cast<std::size_t>(state.range(0));
  std::vector<int> prompt(ctx);
  for (std::size_t i = 0; i < ctx; ++i) prompt[i] = static_cast<int>((i * 7919) % 8192);
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), method_config(static_cast<int>(state.range(1))));
  Transformer t(model, caches, {.max_chunk = ctx, .max_context = ctx + 4096});
  int token = argmax(t.prefill(prompt));
  for (auto _ : state) token = argmax(t.decode(token));
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["weight GB/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * model.decode_weight_bytes()), benchmark::Counter::kIsRate,
      benchmark::Counter::kIs1000);
  state.SetLabel(state.range(1) ? "h2o budget 128" : "full");
}
BENCHMARK(BM_Decode)->ArgsProduct({{128, 1024}, {0, 1}})->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(64);

}  // namespace
}  // namespace kvslim::engine

BENCHMARK_MAIN();
