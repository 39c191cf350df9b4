// KVCache::attend computes, from each method's own storage, what a straightforward fp32 attention
// over the materialised rows computes (to fp16 rounding of the decoded values): every method, odd
// head counts and lengths, every bit width and group size, causal masking by position, GQA, the
// probabilities, and every Highway target this CPU has.
#include <gtest/gtest.h>


#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "simd_targets.h"
#include "attend/attend_kernels.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::normal_fp16;

// out [B, S, Hq, D], probs [B, Hkv, S, rows]: fp32 softmax over the view's rows a query may see.
void reference_attention(const CacheView& v, const std::vector<float>& q, std::size_t S, std::size_t Hq,
                         const std::vector<std::int64_t>& qpos, std::vector<float>& out, std::vector<float>& probs) {
  const std::size_t B = v.batch, Hkv = v.heads, D = v.head_dim, N = v.tokens, group = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  out.assign(B * S * Hq * D, 0.0f);
  probs.assign(B * Hkv * S * N, 0.0f);
  std::vector<double> logit(N);
  for (std::size_t b = 0; b < B; ++b) {
    for (std::size_t h = 0; h < Hq; ++h) {
      const std::size_t g = h / group;
      for (std::size_t s = 0; s < S; ++s) {
        const float* qv = q.data() + ((b * S + s) * Hq + h) * D;
        double mx = -std::numeric_limits<double>::infinity();
        for (std::size_t i = 0; i < N; ++i) {
          if (v.position(b, g, i) > qpos[s]) {
            logit[i] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double dot = 0;
          for (std::size_t c = 0; c < D; ++c) dot += qv[c] * fp16_to_f32(v.key_row(b, g, i)[c]);
          logit[i] = dot * scale;
          mx = std::max(mx, logit[i]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        for (std::size_t i = 0; i < N; ++i) sum += std::exp(logit[i] - mx);
        float* o = out.data() + ((b * S + s) * Hq + h) * D;
        for (std::size_t i = 0; i < N; ++i) {
          const double p = std::exp(logit[i] - mx) / sum;
          probs[((b * Hkv + g) * S + s) * N + i] += static_cast<float>(p);
          for (std::size_t c = 0; c < D; ++c) o[c] += static_cast<float>(p * fp16_to_f32(v.value_row(b, g, i)[c]));
        }
      }
    }
  }
}

// attend() against the reference for S queries at `qpos` (query heads Hq).
void expect_matches_reference(KVCache& cache, std::size_t Hq, const std::vector<std::int64_t>& qpos, unsigned seed,
                              const std::string& what) {
  const CacheView v = cache.materialize();
  ASSERT_EQ(v.tokens, cache.rows()) << what;
  const std::size_t B = v.batch, S = qpos.size(), D = v.head_dim;
  const auto q = normal_fp16(B * S * Hq * D, seed);
  std::vector<float> ref_out, ref_probs;
  reference_attention(v, q, S, Hq, qpos, ref_out, ref_probs);
  std::vector<float> out(ref_out.size(), -1.0f), probs(ref_probs.size(), -1.0f);
  const QueryBlock qb{q.data(), B, S, Hq, D};
  cache.attend(qb, qpos, out.data(), probs.data());
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], ref_out[i], 4e-3 * (1.0 + std::fabs(ref_out[i]))) << what << " out[" << i << "]";
  }
  for (std::size_t i = 0; i < probs.size(); ++i) {
    ASSERT_NEAR(probs[i], ref_probs[i], 2e-3) << what << " probs[" << i << "]";
  }
  // Without probs the output is the same.
  std::vector<float> out2(out.size());
  cache.attend(qb, qpos, out2.data());
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out2[i], out[i], 1e-5 * (1.0 + std::fabs(out[i]))) << what;
}

using testing::for_each_target;

// A prompt of `prompt` tokens with its own queries (causal within the chunk), then `decode` single
// steps each checked, for a cache of `config` with B x Hkv heads of D and Hq query heads.
void run_sequence(const KVCacheConfig& config, std::size_t B, std::size_t Hkv, std::size_t Hq, std::size_t D,
                  std::size_t prompt, std::size_t decode, const std::string& what) {
  auto cache = KVCacheFactory::create(config);
  KV first(B, Hkv, prompt, D, 11);
  std::vector<std::int64_t> pos(prompt);
  for (std::size_t i = 0; i < prompt; ++i) pos[i] = static_cast<std::int64_t>(i);
  cache->append(first.keys(), first.values(), pos);
  expect_matches_reference(*cache, Hq, pos, 3, what + " prompt");
  for (std::size_t t = 0; t < decode; ++t) {
    KV step(B, Hkv, 1, D, 100 + static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{static_cast<std::int64_t>(prompt + t)};
    cache->append(step.keys(), step.values(), p);
    if (t % 16 == 0 || t + 1 == decode) expect_matches_reference(*cache, Hq, p, 200 + static_cast<unsigned>(t), what + " step " + std::to_string(t));
  }
}

TEST(Attend, SlotMethodsMatchReference) {
  for_each_target([] {
    for (const std::string method : {"full", "streaming", "h2o", "squeeze", "pyramidkv"}) {
      KVCacheConfig c = testing::config_for(method);
      c.streaming_budget = c.h2o_budget = c.squeeze_budget = c.pyramidkv_budget = 40;
      run_sequence(c, 1, 3, 9, 40, 67, 8, method + " D40 Hkv3 Hq9");
      run_sequence(c, 2, 2, 2, 128, 45, 4, method + " B2 D128 MHA");
    }
  });
}

TEST(Attend, KiviEveryBitWidthAndGroupSize) {
  for_each_target([] {
    for (int bits = 1; bits <= 8; ++bits) {
      for (int gs : {32, 64, 128}) {
        KVCacheConfig c = testing::config_for("kivi");
        c.kivi_bits = bits;
        c.kivi_group_size = gs;
        c.kivi_staging = gs;
        const std::string what = "kivi" + std::to_string(bits) + " gs" + std::to_string(gs);
        run_sequence(c, 1, 3, 6, 64, 2 * gs + 13, gs % 64 == 0 ? 4 : gs + 3, what);
      }
    }
  });
}

TEST(Attend, ZipcacheMixedPrecisionMatchesReference) {
  for_each_target([] {
    for (auto [hi, lo] : {std::pair{4, 2}, std::pair{8, 1}, std::pair{3, 3}, std::pair{5, 2}}) {
      for (double frac : {0.0, 0.2, 0.5, 1.0}) {
        for (bool quantize_values : {true, false}) {
          KVCacheConfig c = testing::config_for("zipcache");
          c.zipcache_hi_bits = hi;
          c.zipcache_lo_bits = lo;
          c.zipcache_hi_fraction = frac;
          c.zipcache_quantize_values = quantize_values;
          c.zipcache_group_size = 32;
          c.zipcache_staging = 32;
          const std::string what = "zipcache " + std::to_string(hi) + "/" + std::to_string(lo) + " frac " +
                                   std::to_string(frac) + (quantize_values ? "" : " fp16 values");
          run_sequence(c, 1, 1, 3, 72, 77, 35, what);
        }
      }
    }
    KVCacheConfig c = testing::config_for("zipcache");
    c.zipcache_staging = 0;  // every call its own block, decode tokens included
    run_sequence(c, 1, 2, 8, 128, 50, 5, "zipcache staging 0");
  });
}

// The integer (VNNI) kernels stand in for the fp32 ones on packed codes where the CPU has them:
// both must give the same attention (the int8 split of queries and probabilities errs by ~2^-15).
// Every row geometry they take (16, 32 and 64 bytes a row: in-register and buffered interleave),
// query groups of 1-6 heads (padded passes of four), groups of rows that are not a multiple of four
// and short last groups (staging 0: each call its own block), mixed blocks, and a zero query.
void expect_int8_matches_fp32(const KVCacheConfig& c, std::size_t D, std::size_t Hkv, std::size_t Hq, std::size_t S,
                              bool zero_query, const std::string& what) {
  auto cache = KVCacheFactory::create(c);
  KV kv(1, Hkv, S, D, 31);
  std::vector<std::int64_t> pos(S);
  for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
  cache->append(kv.keys(), kv.values(), pos);
  for (std::size_t t = 0; t < 3; ++t) {  // a few decode tokens: short blocks with staging 0
    KV step(1, Hkv, 1, D, 50 + static_cast<unsigned>(t));
    cache->append(step.keys(), step.values(), std::vector<std::int64_t>{static_cast<std::int64_t>(S + t)});
  }
  const std::size_t N = cache->rows();
  auto q = normal_fp16(Hq * D, 41);
  if (zero_query) std::fill_n(q.begin(), D, 0.0f);
  const std::vector<std::int64_t> qpos{static_cast<std::int64_t>(S + 3)};
  const QueryBlock qb{q.data(), 1, 1, Hq, D};
  std::vector<float> with(Hq * D), without(Hq * D), p_with(Hkv * N), p_without(Hkv * N);
  cache->attend(qb, qpos, with.data(), p_with.data());
  attend::set_int8_logits_enabled(false);
  cache->attend(qb, qpos, without.data(), p_without.data());
  attend::set_int8_logits_enabled(true);
  for (std::size_t i = 0; i < with.size(); ++i) {
    ASSERT_NEAR(with[i], without[i], 1e-4 * (1.0 + std::fabs(without[i]))) << what << " out[" << i << "]";
  }
  for (std::size_t i = 0; i < p_with.size(); ++i) {
    ASSERT_NEAR(p_with[i], p_without[i], 1e-6 + 3e-4 * p_without[i]) << what << " probs[" << i << "]";
  }
}

TEST(Attend, Int8KernelsMatchTheFp32KernelsTheyReplace) {
  if (!attend::int8_logits_available()) GTEST_SKIP() << "no AVX-512 VNNI + VBMI on this CPU";
  for (std::size_t D : {32u, 64u, 128u, 256u}) {
    for (int bits : {2, 4, 8}) {
      if (!attend::packed_int8_supported(D, bits)) continue;
      for (const std::string method : {"kivi", "zipcache"}) {
        KVCacheConfig c = testing::config_for(method);
        c.kivi_bits = bits;
        c.zipcache_hi_bits = bits;
        c.zipcache_lo_bits = bits == 8 ? 4 : 2;
        const std::string what = method + " bits " + std::to_string(bits) + " D " + std::to_string(D);
        expect_int8_matches_fp32(c, D, 2, 8, 300, false, what);
        expect_int8_matches_fp32(c, D, 2, 6, 300, true, what + " 3 queries, one zero");
        expect_int8_matches_fp32(c, D, 1, 5, 300, false, what + " 5 queries");
        expect_int8_matches_fp32(c, D, 3, 3, 200, false, what + " MHA");
        c.kivi_group_size = c.zipcache_group_size = 30;  // sets of four rows cross no group
        c.kivi_staging = c.zipcache_staging = 0;         // every call a block: short last groups
        expect_int8_matches_fp32(c, D, 2, 8, 237, false, what + " groups of 30, staging 0");
      }
    }
  }
}

// With the integer kernels off, the fp32 kernels over packed codes still match the reference.
TEST(Attend, PackedFp32KernelsMatchReferenceWithoutInt8) {
  attend::set_int8_logits_enabled(false);
  for (int bits : {2, 4, 8}) {
    KVCacheConfig c = testing::config_for("kivi");
    c.kivi_bits = bits;
    run_sequence(c, 1, 2, 8, 64, 77, 5, "kivi" + std::to_string(bits) + " fp32 kernels");
  }
  KVCacheConfig z = testing::config_for("zipcache");
  run_sequence(z, 1, 2, 8, 128, 77, 5, "zipcache fp32 kernels");
  attend::set_int8_logits_enabled(true);
}

// The softmax weights e^(x - shift): relative error <= 1e-6 down to x - shift = -86 (then below
// 1e-37: nothing next to the maximum's 1), exactly 0 for a masked (-inf) score, and the sum of
// what it wrote; every target, lengths with and without a vector tail.
TEST(Attend, ExpShiftMatchesExpOverTheWeightRange) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for_each_target([&] {
    for (std::size_t n : {1u, 7u, 16u, 33u, 4099u}) {
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = 2.5f - 103.0f * static_cast<float>(i) / static_cast<float>(n);
      if (n > 3) x[3] = ninf;
      std::vector<float> y = x;
      const float shift = 2.0f;
      const float sum = attend::exp_shift(y.data(), n, shift);
      double total = 0;
      for (std::size_t i = 0; i < n; ++i) {
        total += y[i];
        const double want = x[i] == ninf ? 0.0 : std::exp(static_cast<double>(x[i]) - shift);
        if (x[i] == ninf) {
          ASSERT_EQ(y[i], 0.0f) << "n=" << n;
        } else if (x[i] - shift >= -86.0f) {
          ASSERT_NEAR(y[i], want, 1e-6 * want) << "n=" << n << " x=" << x[i];
        } else {
          ASSERT_GE(y[i], 0.0f);
          ASSERT_LE(y[i], 1e-37f) << "n=" << n << " x=" << x[i];
        }
      }
      ASSERT_NEAR(sum, total, 1e-6 * total) << "n=" << n;
    }
  });
}

// What the benchmarks print about the packed-code kernels follows what attend really uses.
TEST(Attend, PackedKernelNameFollowsTheIntegerPath) {
  const std::string on = attend_packed_kernels();
  EXPECT_EQ(on.find("int8") == 0, attend::int8_logits_available()) << on;
  attend::set_int8_logits_enabled(false);
  const std::string off = attend_packed_kernels();
  attend::set_int8_logits_enabled(true);
  EXPECT_EQ(off.rfind("fp32 kernels (", 0), 0u) << off;
}

TEST(Attend, QueriesBeforeEveryRowSeeNothing) {
  auto cache = KVCacheFactory::create(testing::config_for("full"));
  KV kv(1, 1, 4, 8, 1);
  cache->append(kv.keys(), kv.values(), std::vector<std::int64_t>{10, 11, 12, 13});
  const auto q = normal_fp16(2 * 8, 5);
  std::vector<float> out(16, 7.0f), probs(2 * 4, 7.0f);
  const std::vector<std::int64_t> qpos{3, 11};  // the first sees no row, the second sees two
  cache->attend(QueryBlock{q.data(), 1, 2, 1, 8}, qpos, out.data(), probs.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], 0.0f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(probs[i], 0.0f);
  EXPECT_NEAR(probs[4] + probs[5], 1.0f, 1e-6);
  EXPECT_EQ(probs[6], 0.0f);
  EXPECT_EQ(probs[7], 0.0f);
}

TEST(Attend, BeforeTheFirstAppendOutIsZero) {
  for (const std::string method : {"full", "h2o", "kivi", "zipcache"}) {
    auto cache = KVCacheFactory::create(testing::config_for(method));
    const auto q = normal_fp16(4 * 16, 5);
    std::vector<float> out(q.size(), 3.0f);
    const std::vector<std::int64_t> qpos{0};
    cache->attend(QueryBlock{q.data(), 1, 1, 4, 16}, qpos, out.data());
    for (float x : out) EXPECT_EQ(x, 0.0f) << method;
    EXPECT_EQ(cache->rows(), 0u);
  }
}

TEST(Attend, WrongShapesAreRejectedNamingTheMismatch) {
  for (const std::string method : {"full", "kivi"}) {
    auto cache = KVCacheFactory::create(testing::config_for(method));
    KV kv(1, 2, 5, 16, 1);
    cache->append(kv.keys(), kv.values());
    const auto q = normal_fp16(3 * 16 * 2, 5);
    std::vector<float> out(q.size());
    const std::vector<std::int64_t> one{4}, two{3, 4};
    EXPECT_THROW(cache->attend(QueryBlock{q.data(), 1, 1, 3, 16}, one, out.data()), InputError) << "3 % 2";
    EXPECT_THROW(cache->attend(QueryBlock{q.data(), 1, 1, 2, 8}, one, out.data()), InputError) << "head_dim";
    EXPECT_THROW(cache->attend(QueryBlock{q.data(), 2, 1, 2, 16}, one, out.data()), InputError) << "batch";
    EXPECT_THROW(cache->attend(QueryBlock{q.data(), 1, 1, 2, 16}, two, out.data()), InputError) << "positions";
    try {
      cache->attend(QueryBlock{q.data(), 1, 1, 3, 16}, one, out.data());
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("kv_heads=2"), std::string::npos) << e.what();
    }
  }
}

TEST(Attend, ParallelForGivesTheSameResult) {
  KVCacheConfig c = testing::config_for("kivi");
  auto cache = KVCacheFactory::create(c);
  KV kv(1, 4, 300, 64, 1);
  cache->append(kv.keys(), kv.values());
  const auto q = normal_fp16(8 * 64, 5);
  const std::vector<std::int64_t> qpos{299};
  std::vector<float> a(q.size()), b(q.size());
  cache->attend(QueryBlock{q.data(), 1, 1, 8, 64}, qpos, a.data());
  std::size_t tasks = 0;
  const ParallelFor pf = [&](std::size_t n, const std::function<void(std::size_t)>& task) {
    for (std::size_t i = n; i-- > 0;) task(i);  // reverse order: tasks must be independent
    tasks = n;
  };
  cache->attend(QueryBlock{q.data(), 1, 1, 8, 64}, qpos, b.data(), nullptr, &pf);
  EXPECT_EQ(tasks, 4u);
  EXPECT_EQ(a, b);
}

// attend's probabilities feed the attention-scored eviction directly (no remapping).
TEST(Attend, ProbsFeedTheObservationHook) {
  KVCacheConfig c = testing::config_for("h2o");
  c.h2o_budget = 16;
  c.h2o_n_sink = 2;
  c.evict_scoring = "attention";
  auto cache = KVCacheFactory::create(c);
  const std::size_t Hkv = 2, Hq = 4, D = 32;
  for (std::size_t t = 0; t < 60; ++t) {
    KV kv(1, Hkv, 1, D, static_cast<unsigned>(t));
    const std::vector<std::int64_t> p{static_cast<std::int64_t>(t)};
    cache->append(kv.keys(), kv.values(), p);
    const auto q = normal_fp16(Hq * D, 1000 + static_cast<unsigned>(t));
    std::vector<float> out(Hq * D), probs(Hkv * cache->rows());
    cache->attend(QueryBlock{q.data(), 1, 1, Hq, D}, p, out.data(), probs.data());
    cache->observe_attention(AttentionObservation{probs.data(), 1, Hkv, 1, cache->rows(), cache->rows(), p});
    ASSERT_LE(cache->rows(), 16u);
  }
  EXPECT_EQ(cache->rows(), 16u);
}

}  // namespace
}  // namespace kvslim
