// `kvslim bench attend`: decode attention of one layer (one query token, GQA) computed by each
// cache over its own storage, at several context lengths, against fp16 attention (the full cache)
// over the same tokens in the same run. Prints time per call, the speed-up over fp16, and the
// bytes each kernel reads per second as a fraction of memcpy's GB/s measured by the same run with
// the same threads (decode attention is bound by the bytes it reads).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_attend_cuda.h"
#include "cli/command.h"
#include "engine/ops.h"
#include "kvslim/convert.h"
#include "kvslim/factory.h"
#include "kvslim/methods.h"

namespace kvslim::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::size_t> contexts{1024, 4096, 16384, 32768};
  std::vector<int> head_dims{128, 64};
  int kv_heads = 8, q_heads = 32, threads = 2, repeats = 15;
  // Method specs (kvslim/methods.h): methods or the registry's eval variants.
  std::vector<std::string> caches{"full", "kivi4", "kivi2", "zipcache_4_2_h20"};
};

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A cache by method spec (kvslim/methods.h: NAME or NAME@field=value,..., NAME a method or one of
// the registry's eval variants: kivi4, zipcache_4_2_h20).
KVCacheConfig config_of(const std::string& name) { return config_from_spec(name); }

// Bytes attend reads: the stored keys and values (codes + group parameters, or fp16 rows) and a
// position per row and head.
double bytes_read(const KVCache& cache) {
  const CacheStats st = cache.stats();
  const double positions = static_cast<double>(st.tokens_kept * st.batch * st.heads * sizeof(std::int64_t));
  if (st.has_figure("resident_key_bytes")) {
    return st.figure("resident_key_bytes") + st.figure("resident_value_bytes") + positions;
  }
  return static_cast<double>(st.kept_fp16_bytes) + positions;
}

// memcpy GB/s (bytes copied per second) with `threads` threads each copying its half, best of 5.
double memcpy_gbs(int threads) {
  const std::size_t n = 256u << 20;
  std::vector<char> src(n, 1), dst(n, 0);
  double best = 0;
  for (int r = 0; r < 6; ++r) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    const std::size_t part = n / static_cast<std::size_t>(threads);
    for (int t = 1; t < threads; ++t) {
      pool.emplace_back([&, t] { std::memcpy(dst.data() + t * part, src.data() + t * part, part); });
    }
    std::memcpy(dst.data(), src.data(), part);
    for (auto& th : pool) th.join();
    if (r > 0) best = std::max(best, static_cast<double>(n) / seconds(t0) / 1e9);
  }
  if (dst[n / 2] != 1) throw std::logic_error("memcpy check failed");
  return best;
}

int run(const Options& o) {
  if (o.q_heads % o.kv_heads != 0) throw std::invalid_argument("--q-heads must be a multiple of --kv-heads");
  engine::ThreadPool pool(o.threads);
  const ParallelFor parallel = [&pool](std::size_t n, const std::function<void(std::size_t)>& task) {
    auto each = [&task](int i) { task(static_cast<std::size_t>(i)); };
    pool.for_each(static_cast<int>(n), each);
  };
  for (const std::string& name : o.caches) config_of(name);  // every name checked before any work
  if (o.caches.empty() || o.caches.front() != "full") throw std::invalid_argument("--cache: list full first (the ratios divide by it)");
  const double copy = memcpy_gbs(o.threads);
  std::printf("decode attention of one layer: %d KV heads, %d query heads, 1 query token, %d threads; best of %d\n",
              o.kv_heads, o.q_heads, o.threads, o.repeats);
  std::printf("memcpy (%d threads): %.2f GB/s copied\n", o.threads, copy);
  std::printf("kivi / zipcache codes read by: %s\n", attend_packed_kernels());
  std::printf("%-5s %7s %-16s %10s %10s %12s %10s %9s\n", "D", "tokens", "cache", "us/call", "x fp16", "MB read",
              "GB/s read", "/memcpy");
  const std::size_t chunk = 1024;
  for (int D : o.head_dims) {
    const std::size_t d = static_cast<std::size_t>(D), H = static_cast<std::size_t>(o.kv_heads);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<std::uint16_t> keys(H * chunk * d), values(H * chunk * d);
    std::vector<float> q(static_cast<std::size_t>(o.q_heads) * d), out(q.size());
    for (auto& x : q) x = dist(rng);
    for (std::size_t ctx : o.contexts) {
      // Every cache holds the same tokens; calls are interleaved round-robin and the best of each
      // is kept, so a burst of load from other processes hits every cache alike.
      std::vector<std::unique_ptr<KVCache>> caches;
      for (const std::string& name : o.caches) caches.push_back(KVCacheFactory::create(config_of(name)));
      std::mt19937 data_rng(11);
      for (std::size_t t0 = 0; t0 < ctx; t0 += chunk) {
        const std::size_t n = std::min(chunk, ctx - t0);
        for (std::size_t i = 0; i < H * n * d; ++i) {
          keys[i] = f32_to_fp16(dist(data_rng));
          values[i] = f32_to_fp16(dist(data_rng));
        }
        for (auto& cache : caches) {
          cache->append(make_block_fp16(keys.data(), 1, H, n, d), make_block_fp16(values.data(), 1, H, n, d));
        }
      }
      const std::vector<std::int64_t> qpos{static_cast<std::int64_t>(ctx)};
      const QueryBlock qb{q.data(), 1, 1, static_cast<std::size_t>(o.q_heads), d};
      std::vector<double> best(caches.size(), 1e30);
      for (int r = 0; r < o.repeats + 2; ++r) {
        for (std::size_t c = 0; c < caches.size(); ++c) {
          const auto t0 = Clock::now();
          caches[c]->attend(qb, qpos, out.data(), nullptr, &parallel);
          if (r >= 2) best[c] = std::min(best[c], seconds(t0));
        }
      }
      double fp16_us = 0;
      for (std::size_t c = 0; c < caches.size(); ++c) {
        const std::string& name = o.caches[c];
        const double us = best[c] * 1e6, bytes = bytes_read(*caches[c]);
        if (name == "full") fp16_us = us;
        const double gbs = bytes / best[c] / 1e9;
        char ratio[32] = "-";
        if (fp16_us > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", fp16_us / us);
        std::printf("%-5d %7zu %-16s %10.1f %10s %12.2f %10.2f %8.0f%%\n", D, ctx, name.c_str(), us, ratio,
                    bytes / 1e6, gbs, 100.0 * gbs / copy);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

const CommandRegistrar registrar("bench attend", "decode attention over each cache's own storage vs fp16, bytes/s vs memcpy",
                                 [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--context", o->contexts, "tokens in the cache")->capture_default_str()->check(CLI::Range(1, 1 << 22));
  app.add_option("--head-dim", o->head_dims, "head dimensions")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", o->kv_heads, "KV heads")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--q-heads", o->q_heads, "query heads (a multiple of --kv-heads)")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--cache", o->caches, "method specs: a method or an eval variant (kvslim eval --list-methods: kivi2, zipcache_4_2_h20...), "
                 "optionally @field=value,... (full first: the ratios divide by it)")->capture_default_str();
  app.add_option("--threads", o->threads, "threads")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--repeats", o->repeats, "timed calls per point (best reported)")->capture_default_str()->check(CLI::Range(1, 1000));
  // The GPU: kvslim's device caches at batch x context shapes (bench/cuda/sdpa_bench.py adds torch SDPA).
  auto device = std::make_shared<std::string>("cpu");
  auto batches = std::make_shared<std::vector<std::size_t>>(CudaAttendOptions{}.batches);
  auto json = std::make_shared<std::string>();
  auto eager_stream = std::make_shared<std::string>("legacy");
  app.add_option("--device", *device, "cpu, or cuda / cuda:N: the device caches (defaults then: --context 8192 32768 "
                                      "131072, --cache full kivi4 kivi2)")
      ->capture_default_str();
  app.add_option("--batch", *batches, "--device cuda: batch sizes")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--json", *json, "--device cuda: write every row as JSON here");
  app.add_option("--eager-stream", *eager_stream, "--device cuda: the eager calls' stream, the legacy default stream "
                                                  "(torch's default) or one of the bench's own (non-blocking)")
      ->capture_default_str()
      ->check(CLI::IsMember({"legacy", "own"}));
  return [o, device, batches, json, eager_stream, &app] {
    if (*device == "cpu") return run(*o);
    KVCacheConfig probe;
    probe.device = *device;
    if (probe.device_index() < 0) throw std::invalid_argument("--device " + *device + ": expected cpu, cuda or cuda:N");
    CudaAttendOptions c;
    c.device = probe.device_index();
    c.batches = *batches;
    if (app.count("--context") > 0) c.contexts = o->contexts;
    if (app.count("--head-dim") > 0) c.head_dims = o->head_dims;
    if (app.count("--cache") > 0) c.caches = o->caches;
    c.kv_heads = o->kv_heads;
    c.q_heads = o->q_heads;
    c.repeats = o->repeats;
    c.json = *json;
    c.eager_own_stream = *eager_stream == "own";
    return run_cuda_attend_bench(c);
  };
});

}  // namespace
}  // namespace kvslim::cli
