// The cache contract beyond attention: growth of `full`, per-layer views, the schedule floors,
// layer reset after finalisation, a forgotten observation hook, and the threading rule (two threads
// on two layers of one CacheSet; CI also runs this binary under ThreadSanitizer).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvslim/squeeze.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::normal_fp16;

// Growth is geometric: over n single-token appends the store moves O(log n) times (it moved on
// every step before: 6.1 ms per step at 1k rows for one layer of 8x128 heads).
TEST(FullCache, StoreMovesLogarithmicallyOften) {
  auto cache = KVCacheFactory::create(testing::config_for("full"));
  const std::size_t n = 4096;
  std::size_t moves = 0;
  const std::uint16_t* last = nullptr;
  for (std::size_t t = 0; t < n; ++t) {
    KV kv(1, 2, 1, 8, static_cast<unsigned>(t));
    cache->append(kv.keys(), kv.values());
    const std::uint16_t* now = cache->materialize().keys;
    if (now != last) ++moves;
    last = now;
  }
  EXPECT_EQ(cache->rows(), n);
  EXPECT_LE(moves, 2 * static_cast<std::size_t>(std::log2(n)) + 2) << moves << " moves for " << n << " appends";
  // The capacity never exceeds 1.5x what is kept (plus the minimum), so memory stays bounded.
  const std::size_t per_row = 2 * (2 * 8 * sizeof(std::uint16_t) + sizeof(float) + sizeof(std::int64_t));
  EXPECT_LE(cache->stats().resident_bytes, (n + n / 2) * per_row + 16 * per_row);
}

// reserve(n): a full cache told the run's length allocates once (a prompt, then decode steps up
// to n tokens: no move after the first append), holds exactly n rows' worth, and grows again
// geometrically past it. Bounded caches ignore the hint (h2o's store stays at its budget).
TEST(FullCache, ReserveAllocatesOnceForTheWholeRun) {
  auto cache = KVCacheFactory::create(testing::config_for("full"));
  const std::size_t prompt = 100, n = 612;
  cache->reserve(n);
  KV first(1, 2, prompt, 8, 1);
  cache->append(first.keys(), first.values());
  const std::uint16_t* store = cache->materialize().keys;
  for (std::size_t t = prompt; t < n; ++t) {
    KV kv(1, 2, 1, 8, static_cast<unsigned>(t));
    cache->append(kv.keys(), kv.values());
    ASSERT_EQ(cache->materialize().keys, store) << "moved at token " << t;
  }
  const std::size_t per_row = 2 * (2 * 8 * sizeof(std::uint16_t) + sizeof(float) + sizeof(std::int64_t));
  EXPECT_EQ(cache->stats().resident_bytes, n * per_row);
  KV more(1, 2, 1, 8, 9);
  cache->append(more.keys(), more.values());
  EXPECT_NE(cache->materialize().keys, store);
  EXPECT_EQ(cache->rows(), n + 1);

  KVCacheConfig h = testing::config_for("h2o");
  h.h2o_budget = 64;
  h.evict_profile = "original";
  auto bounded = KVCacheFactory::create(h), plain = KVCacheFactory::create(h);
  bounded->reserve(100000);
  KV kv(1, 2, 300, 8, 3);
  bounded->append(kv.keys(), kv.values());
  plain->append(kv.keys(), kv.values());
  EXPECT_EQ(bounded->stats().resident_bytes, plain->stats().resident_bytes);
}

// Compressed layers decode into their own scratch: one layer's materialize() leaves another
// layer's view intact (they shared one scratch before).
TEST(CacheSetViews, MaterializeOfOneLayerLeavesAnotherLayersViewIntact) {
  for (const std::string method : {"kivi", "zipcache"}) {
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), testing::config_for(method));
    KV a(1, 2, 200, 16, 1), b(1, 2, 300, 16, 2);
    set.at(0).append(a.keys(), a.values());
    set.at(1).append(b.keys(), b.values());
    const CacheView v0 = set.at(0).materialize();
    const std::vector<std::uint16_t> keys0(v0.keys, v0.keys + 2 * v0.head_stride * 16);
    const CacheView v1 = set.at(1).materialize();
    ASSERT_EQ(v1.tokens, 300u);
    EXPECT_EQ(std::memcmp(v0.keys, keys0.data(), keys0.size() * sizeof(std::uint16_t)), 0) << method;
    EXPECT_NE(v0.keys, v1.keys) << method;
  }
}

// Per-layer schedules respect the recent window: every config that passes validate() runs.
// (pyramidkv with evict_recent_window=100 and squeeze 16/8 threw "no evictable row" mid-run.)
TEST(ScheduleFloors, TaperedLayersKeepRoomToEvictBeyondTheWindow) {
  struct Case {
    const char* method;
    int budget, window;
    const char* scoring;
  };
  for (const Case& k : {Case{"pyramidkv", 512, 100, "key_proxy"}, Case{"pyramidkv", 512, 100, "attention"},
                        Case{"squeeze", 16, 8, "key_proxy"}, Case{"squeeze", 16, 8, "attention"},
                        Case{"pyramidkv", 64, 16, "key_proxy"}, Case{"squeeze", 64, 16, "attention_normalized"}}) {
    KVCacheConfig c = testing::config_for(k.method);
    c.pyramidkv_budget = c.squeeze_budget = k.budget;
    c.evict_recent_window = k.window;
    c.evict_scoring = k.scoring;
    const std::string what = std::string(k.method) + " budget " + std::to_string(k.budget) + " window " +
                             std::to_string(k.window) + " " + k.scoring;
    const int L = 8;
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(L, 1, 8), c);
    auto step = [&](int li, const KV& kv, std::int64_t first) {
      std::vector<std::int64_t> pos(kv.S);
      for (std::size_t i = 0; i < kv.S; ++i) pos[i] = first + static_cast<std::int64_t>(i);
      KVCache& cache = set.at(li);
      cache.append(kv.keys(), kv.values(), pos);
      if (cache.needs().attention) {
        const auto q = normal_fp16(kv.S * 8, 9);
        std::vector<float> out(kv.S * 8), probs(kv.S * cache.rows());
        cache.attend(QueryBlock{q.data(), 1, kv.S, 1, 8}, pos, out.data(), probs.data());
        cache.observe_attention(AttentionObservation{probs.data(), 1, 1, kv.S, cache.rows(), cache.rows(), pos});
      }
    };
    const std::size_t prompt = 700;
    for (int li = 0; li < L; ++li) {
      // Layers of different concentration (repeated keys in the early layers): an uneven schedule.
      KV kv(1, 1, prompt, 8, 40 + static_cast<unsigned>(li));
      if (li < L / 2) {
        for (std::size_t i = 1; i < prompt; ++i) std::copy_n(kv.k.data(), 8, kv.k.data() + i * 8);
      }
      ASSERT_NO_THROW(step(li, kv, 0)) << what << " layer " << li;
    }
    for (std::size_t t = 0; t < 150; ++t) {
      for (int li = 0; li < L; ++li) {
        KV kv(1, 1, 1, 8, 1000 + static_cast<unsigned>(t));
        ASSERT_NO_THROW(step(li, kv, static_cast<std::int64_t>(prompt + t))) << what << " layer " << li << " step " << t;
      }
    }
    for (int li = 0; li < L; ++li) {
      const double budget = set.at(li).stats().figure("layer_budget");
      EXPECT_GE(budget, 4 + k.window + 1) << what << " layer " << li;
      EXPECT_LE(set.at(li).rows(), static_cast<std::size_t>(budget) + 1) << what << " layer " << li;
    }
  }
}

// A layer reset on its own after the schedule was finalised keeps its scheduled budget (it stayed
// at the average budget forever before: the coordinator ignores reports once final).
TEST(SqueezeReset, LayerResetAfterFinalisationKeepsItsScheduledBudget) {
  KVCacheConfig c = testing::config_for("squeeze");
  c.squeeze_budget = 32;
  const int L = 4;
  CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(L, 1, 8), c);
  for (int li = 0; li < L; ++li) {
    KV kv(1, 1, 200, 8, 7 + static_cast<unsigned>(li));
    if (li == 0) {
      for (std::size_t i = 1; i < 200; ++i) std::copy_n(kv.k.data(), 8, kv.k.data() + i * 8);
    }
    set.at(li).append(kv.keys(), kv.values());
  }
  ASSERT_TRUE(set.coordinator()->is_finalized());
  const int scheduled = *set.coordinator()->resolved_budget(1);
  ASSERT_NE(scheduled, 32);
  set.at(1).reset();
  KV again(1, 1, 200, 8, 99);
  set.at(1).append(again.keys(), again.values());
  KV one(1, 1, 1, 8, 100);
  set.at(1).append(one.keys(), one.values());
  EXPECT_EQ(set.at(1).stats().figure("layer_budget"), scheduled);
  EXPECT_EQ(static_cast<int>(set.at(1).rows()), std::min(scheduled, 201));
  // The set's reset clears the schedule too: the next prompt is scheduled afresh.
  set.reset();
  EXPECT_FALSE(set.coordinator()->is_finalized());
  EXPECT_EQ(set.at(1).stats().figure("layer_budget"), 32);
}

// Attention scoring whose engine never calls observe_attention: the budget still holds (5,000
// rows were kept at budget 64 before, reallocating on every token).
TEST(AttentionScoring, BudgetHoldsWhenTheEngineNeverObserves) {
  for (const std::string method : {"h2o", "squeeze", "pyramidkv"}) {
    KVCacheConfig c = testing::config_for(method);
    c.h2o_budget = c.squeeze_budget = c.pyramidkv_budget = 64;
    c.evict_scoring = "attention";
    auto cache = KVCacheFactory::create(c);
    std::size_t resident_max = 0;
    for (std::size_t t = 0; t < 3000; ++t) {
      KV kv(1, 2, 1, 16, static_cast<unsigned>(t));
      cache->append(kv.keys(), kv.values());
      ASSERT_LE(cache->rows(), 65u) << method << " step " << t;
      resident_max = std::max(resident_max, cache->stats().resident_bytes);
    }
    EXPECT_LE(resident_max, 2u * 66 * 2 * 16 * 2 * 2 + 2u * 66 * 20 * 2) << method;
  }
}

// The threading rule: two threads, each driving its own layer of one CacheSet through every call
// (append, attend with probs + observe when asked, materialize, stats, reset), give exactly the
// results of the same calls made one thread after the other. The prompts go in first, in layer
// order (a squeeze layer's view of the schedule depends on which layer reported first, by design).
struct LayerDriver {
  CacheSet& set;
  int layer;
  bool one_call = false;  // attend_and_observe instead of attend + observe_attention
  std::int64_t pos = 0;
  std::vector<double> trace;

  void step(std::size_t S, unsigned seed) {
    KVCache& cache = set.at(static_cast<std::size_t>(layer));
    const std::size_t H = 2, Hq = 4, D = 16;
    // Data from one seeded pool (a generator per step would dominate the run time).
    static const std::vector<float> pool = normal_fp16(1 << 16, 123);
    const std::size_t n = S * H * D, span = pool.size() - 2 * n - S * Hq * D;
    const float* k = pool.data() + (seed * 977u) % span;
    const float* v = k + n;
    const float* q = v + n;
    std::vector<std::int64_t> p(S);
    for (std::size_t i = 0; i < S; ++i) p[i] = pos++;
    cache.append(make_block(k, 1, H, S, D), make_block(v, 1, H, S, D), p);
    std::vector<float> out(S * Hq * D), probs(H * S * cache.rows());
    const bool observe = cache.needs().attention;
    if (one_call) {
      cache.attend_and_observe(QueryBlock{q, 1, S, Hq, D}, p, out.data(), observe ? probs.data() : nullptr, H);
    } else {
      cache.attend(QueryBlock{q, 1, S, Hq, D}, p, out.data(), observe ? probs.data() : nullptr);
      if (observe) cache.observe_attention(AttentionObservation{probs.data(), 1, H, S, cache.rows(), cache.rows(), p});
    }
    double sum = 0;
    for (float x : out) sum += x;
    trace.push_back(sum);
    trace.push_back(static_cast<double>(cache.rows()));
  }
  void prompt() { step(96, 17 + static_cast<unsigned>(layer)); }
  void decode(std::size_t steps) {
    KVCache& cache = set.at(static_cast<std::size_t>(layer));
    for (std::size_t t = 0; t < steps; ++t) {
      step(1, 1000 + static_cast<unsigned>(t) + 7919u * static_cast<unsigned>(layer));
      if (t % 97 == 0) trace.push_back(static_cast<double>(cache.materialize().tokens));
      if (t % 89 == 0) trace.push_back(static_cast<double>(cache.stats().tokens_kept));
      if (t % 500 == 499) {  // a new sequence on this layer alone (keeps `full` small)
        cache.reset();
        pos = 0;
        step(96, 31 + static_cast<unsigned>(t));
      }
    }
  }
};

std::vector<KVCacheConfig> threading_configs() {
  std::vector<KVCacheConfig> out;
  for (const std::string& method : method_names()) {
    for (const std::string scoring : {"key_proxy", "attention"}) {
      const bool scored = method == "h2o" || method == "squeeze" || method == "pyramidkv" || method == "zipcache";
      if (!scored && scoring != "key_proxy") continue;
      KVCacheConfig c = testing::config_for(method);
      c.h2o_budget = c.squeeze_budget = c.pyramidkv_budget = c.streaming_budget = 48;
      c.evict_scoring = scoring;
      c.kivi_group_size = 32;
      c.kivi_staging = c.zipcache_staging = 32;
      c.zipcache_group_size = 32;
      if (scoring == "attention") c.zipcache_saliency = "attention_normalized";
      out.push_back(c);
    }
  }
  return out;
}

TEST(ThreadingRule, TwoThreadsOnTwoLayersOfOneSetEveryMethod) {
  const std::size_t steps = 10000;
  for (const KVCacheConfig& c : threading_configs()) {
    const std::string what = c.method + " " + c.evict_scoring;
    CacheSet serial = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), c);
    LayerDriver s0{serial, 0}, s1{serial, 1};
    s0.prompt();
    s1.prompt();
    s0.decode(steps);
    s1.decode(steps);
    CacheSet parallel = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), c);
    LayerDriver p0{parallel, 0}, p1{parallel, 1};
    p0.prompt();
    p1.prompt();
    std::thread other([&] { p1.decode(steps); });
    p0.decode(steps);
    other.join();
    EXPECT_EQ(p0.trace, s0.trace) << what << " layer 0";
    EXPECT_EQ(p1.trace, s1.trace) << what << " layer 1";
  }
}

// KVCache::attend_and_observe is attend with probabilities, then observe_attention of them: every
// method's outputs, rows and views equal those of the two calls; an observing cache needs the
// workspace (named), one that observes nothing attends without it.
TEST(AttendAndObserve, EqualsAttendThenObserveEveryMethod) {
  for (const KVCacheConfig& c : threading_configs()) {
    const std::string what = c.method + " " + c.evict_scoring;
    CacheSet two_calls = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), c);
    CacheSet one_call = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), c);
    LayerDriver a0{two_calls, 0}, a1{two_calls, 1}, b0{one_call, 0, true}, b1{one_call, 1, true};
    for (LayerDriver* d : {&a0, &a1, &b0, &b1}) d->prompt();
    for (LayerDriver* d : {&a0, &a1, &b0, &b1}) d->decode(600);
    EXPECT_EQ(b0.trace, a0.trace) << what << " layer 0";
    EXPECT_EQ(b1.trace, a1.trace) << what << " layer 1";
    KVCache& cache = one_call.at(0);
    const std::vector<float> q(1 * 4 * 16, 0.25f);
    std::vector<float> out(q.size());
    const std::int64_t next = b0.pos;
    if (cache.needs().attention) {
      try {
        cache.attend_and_observe(QueryBlock{q.data(), 1, 1, 4, 16}, std::span<const std::int64_t>(&next, 1), out.data(),
                                 nullptr, 2);
        ADD_FAILURE() << what << ": a null probabilities workspace was accepted";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("probabilities workspace"), std::string::npos) << e.what();
      }
    } else {
      cache.attend_and_observe(QueryBlock{q.data(), 1, 1, 4, 16}, std::span<const std::int64_t>(&next, 1), out.data(),
                               nullptr, 2);
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); })) << what;
    }
  }
}

// The prompts themselves in parallel: the squeeze schedule is finalised by whichever layer reports
// last, and every layer holds its resolved budget after its next call.
TEST(ThreadingRule, ConcurrentPromptsFinaliseTheScheduleOnce) {
  for (int round = 0; round < 20; ++round) {
    KVCacheConfig c = testing::config_for("squeeze");
    c.squeeze_budget = 48;
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), c);
    LayerDriver d0{set, 0}, d1{set, 1};
    std::thread other([&] {
      d1.prompt();
      d1.step(1, 5);
    });
    d0.prompt();
    d0.step(1, 6);
    other.join();
    ASSERT_TRUE(set.coordinator()->is_finalized());
    d0.step(1, 7);
    d1.step(1, 8);
    for (int li = 0; li < 2; ++li) {
      EXPECT_EQ(static_cast<int>(set.at(li).rows()), *set.coordinator()->resolved_budget(li)) << "layer " << li;
    }
  }
}

}  // namespace
}  // namespace kvslim
