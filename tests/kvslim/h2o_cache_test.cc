// The shared H2O eviction core through the h2o cache (seed Evidence: "Eviction"; original tests
// test_squeeze.py 23-31 and the (O) tests of test_h2o.py / test_h2o_cache.py), plus kvslim's
// additions: true positions, the recent window, attention scoring, a 100,000-step invariant run.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include <cstring>

#include "cache/eviction_cache.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;
using testing::sorted_positions;

std::unique_ptr<KVCache> h2o(int budget, int n_sink, int recent = 0, const std::string& scoring = "key_proxy") {
  KVCacheConfig c = testing::config_for("h2o");
  c.h2o_budget = budget;
  c.h2o_n_sink = n_sink;
  c.evict_recent_window = recent;
  c.evict_scoring = scoring;
  return KVCacheFactory::create(c);
}

CacheView step(KVCache& cache, std::size_t S, std::size_t D, unsigned seed, std::size_t B = 1, std::size_t H = 1) {
  KV kv(B, H, S, D, seed);
  return cache.update_and_fetch(kv.keys(), kv.values());
}

TEST(H2O, EmptyViewBeforeFirstUpdate) {
  auto cache = h2o(8, 2);
  EXPECT_EQ(cache->view().tokens, 0u);
  EXPECT_EQ(cache->stats().tokens_kept, 0u);
  EXPECT_EQ(cache->stats().kept_fp16_bytes, 0u);
  EXPECT_EQ(cache->stats().compression_ratio, 1.0);
}

TEST(H2O, BootstrapSingleTokenScoresOne) {
  auto cache = h2o(8, 2);
  const CacheView v = step(*cache, 1, 16, 1);
  EXPECT_EQ(v.tokens, 1u);
  auto* e = dynamic_cast<const EvictionCache*>(cache.get());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->core().scores(0)[0], 1.0f);
}

TEST(H2O, MultiTokenBelowBudgetKeepsAll) {
  auto cache = h2o(16, 4);
  EXPECT_EQ(step(*cache, 8, 16, 1).tokens, 8u);
  EXPECT_EQ(cache->stats().compression_ratio > 0, true);
  EXPECT_EQ(cache->stats().figure("original_compression_ratio"), 1.0);  // below budget the ratio is exactly 1
}

TEST(H2O, BudgetNeverExceededOver40Steps) {
  auto cache = h2o(10, 4);
  for (unsigned s = 0; s < 40; ++s) EXPECT_LE(step(*cache, 1, 32, s).tokens, 10u);
}

TEST(H2O, BudgetPlusOneTrimsToExactlyBudget) {
  auto cache = h2o(6, 2);
  EXPECT_EQ(step(*cache, 7, 16, 3).tokens, 6u);
  auto c5 = h2o(5, 1);
  EXPECT_EQ(step(*c5, 6, 16, 3).tokens, 5u);
}

TEST(H2O, SinksAlwaysPresent) {
  auto cache = h2o(6, 3);
  std::vector<float> sink_keys(24);
  for (int i = 0; i < 24; ++i) sink_keys[i] = 1000.0f + i;
  std::vector<float> sink_values(24, 0.5f);
  cache->update_and_fetch(make_block(sink_keys.data(), 1, 1, 3, 8), make_block(sink_values.data(), 1, 1, 3, 8));
  CacheView v;
  for (unsigned s = 0; s < 20; ++s) v = step(*cache, 1, 8, 100 + s);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(v.position(0, 0, r), r);
    for (int j = 0; j < 8; ++j) EXPECT_EQ(fp16_to_f32(v.key_row(0, 0, r)[j]), 1000.0f + r * 8 + j);
  }
}

TEST(H2O, NoSinksAllowsEveryRowToGo) {
  auto cache = h2o(5, 0);
  for (unsigned s = 0; s < 15; ++s) EXPECT_LE(step(*cache, 1, 16, s).tokens, 5u);
  // Without sinks row 0 has no protection; it stays here only because its score is the highest.
  auto c = h2o(2, 0, 1);
  for (unsigned s = 0; s < 6; ++s) step(*c, 1, 4, s);
  EXPECT_EQ(sorted_positions(c->view()), (std::vector<std::int64_t>{0, 5}));
}

TEST(H2O, ScoresNonNegativeAndAccumulate) {
  auto cache = h2o(12, 2);
  auto* e = dynamic_cast<const EvictionCache*>(cache.get());
  step(*cache, 2, 16, 0);
  const float first = e->core().scores(0)[0];
  for (unsigned s = 1; s < 20; ++s) {
    step(*cache, 1, 16, s);
    for (std::size_t i = 0; i < e->core().rows(); ++i) EXPECT_GE(e->core().scores(0)[i], 0.0f);
  }
  EXPECT_GT(e->core().scores(0)[0], first);  // the sink row keeps gaining mass
}

TEST(H2O, ByteAccounting) {
  auto cache = h2o(8, 2);
  step(*cache, 5, 32, 1);
  CacheStats st = cache->stats();
  EXPECT_EQ(st.kept_fp16_bytes, 5u * 32 * 4);
  EXPECT_EQ(st.seen_fp16_bytes, 5u * 32 * 4);
  for (unsigned s = 0; s < 95; ++s) step(*cache, 1, 32, 10 + s);
  st = cache->stats();
  EXPECT_EQ(st.tokens_seen, 100u);
  EXPECT_EQ(st.seen_fp16_bytes, 100u * 32 * 4);  // full_fp16_bytes(100, 32)
  EXPECT_EQ(st.kept_fp16_bytes, 8u * 32 * 4);
  EXPECT_EQ(st.figure("original_compression_ratio"), 12.5);
  // Resident bytes: what the slots really take (fp16 K+V, a float score and a position per row).
  EXPECT_EQ(st.resident_bytes, 8u * (32 * 4 + 4 + 8));
  EXPECT_GT(st.compression_ratio, 10.0);
}

TEST(H2O, TokensSeenCountsTokensPerHeadAndEveryHeadIsReported) {
  auto cache = h2o(16, 2);
  step(*cache, 6, 8, 1, 1, 2);
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.tokens_seen, 6u);  // the original reports head-tokens (12); kvslim reports tokens per head
  EXPECT_EQ(st.kept_per_head, (std::vector<std::size_t>{6, 6}));
}

TEST(H2O, OutputShapeKeepsBatchHeadsAndDim) {
  auto cache = h2o(5, 1);
  const CacheView v = step(*cache, 12, 8, 2, 2, 3);
  EXPECT_EQ(v.batch, 2u);
  EXPECT_EQ(v.heads, 3u);
  EXPECT_EQ(v.head_dim, 8u);
  EXPECT_EQ(v.tokens, 5u);
}

TEST(H2O, DeterministicAcrossIdenticalInputs) {
  auto a = h2o(9, 3), b = h2o(9, 3);
  CacheView va, vb;
  for (unsigned s = 0; s < 25; ++s) {
    va = step(*a, 1, 16, s);
    vb = step(*b, 1, 16, s);
  }
  ASSERT_EQ(va.tokens, vb.tokens);
  for (std::size_t i = 0; i < va.tokens; ++i) {
    EXPECT_EQ(va.position(0, 0, i), vb.position(0, 0, i));
    EXPECT_EQ(std::memcmp(va.key_row(0, 0, i), vb.key_row(0, 0, i), 32), 0);
  }
}

TEST(H2O, NewcomerIsEvictedSoTheKeptSetFreezes) {
  // The documented scorer gives a newcomer score 0: it is nearly always the one evicted.
  auto cache = h2o(4, 0);
  for (unsigned s = 0; s < 20; ++s) step(*cache, 1, 16, s);
  EXPECT_EQ(sorted_positions(cache->view()), (std::vector<std::int64_t>{0, 1, 2, 3}));
}

TEST(H2O, RecentWindowProtectsTheNewestTokens) {
  auto cache = h2o(8, 2, 3);
  for (unsigned s = 0; s < 50; ++s) {
    step(*cache, 1, 16, s);
    const auto pos = sorted_positions(cache->view());
    const std::int64_t newest = s;
    for (std::int64_t p = std::max<std::int64_t>(0, newest - 2); p <= newest; ++p) {
      EXPECT_TRUE(std::find(pos.begin(), pos.end(), p) != pos.end()) << "position " << p << " at step " << s;
    }
    EXPECT_LE(pos.size(), 8u);
  }
}

TEST(H2O, PositionsStayTrueAfterManyEvictions) {
  auto cache = h2o(16, 4, 4);
  std::vector<std::int64_t> given;
  std::int64_t p = 100;  // positions need not start at 0 nor be contiguous
  for (unsigned s = 0; s < 200; ++s) {
    KV kv(1, 2, 1, 16, s);
    p += 1 + (s % 3);
    const std::int64_t pos[1] = {p};
    const CacheView v = cache->update_and_fetch(kv.keys(), kv.values(), pos);
    given.push_back(p);
    // Every returned row's key is exactly the key that arrived at that position.
    for (std::size_t h = 0; h < 2; ++h) {
      for (std::size_t i = 0; i < v.tokens; ++i) {
        const auto it = std::find(given.begin(), given.end(), v.position(0, h, i));
        ASSERT_NE(it, given.end());
        const unsigned seed = static_cast<unsigned>(it - given.begin());
        KV orig(1, 2, 1, 16, seed);
        EXPECT_EQ(fp16_to_f32(v.key_row(0, h, i)[0]), orig.k[h * 16]);
      }
    }
  }
  const auto pos = sorted_positions(cache->view());
  EXPECT_EQ(std::vector<std::int64_t>(pos.begin(), pos.begin() + 4),
            std::vector<std::int64_t>(given.begin(), given.begin() + 4));  // the sinks
}

TEST(H2O, SingleCallEqualsManySingleTokenCalls) {
  auto one = h2o(12, 2), many = h2o(12, 2);
  KV kv(1, 2, 40, 16, 5);
  one->update_and_fetch(kv.keys(), kv.values());
  for (std::size_t s = 0; s < 40; ++s) {
    std::vector<float> k(2 * 16), v(2 * 16);
    for (std::size_t h = 0; h < 2; ++h) {
      std::copy_n(kv.k.begin() + (h * 40 + s) * 16, 16, k.begin() + h * 16);
      std::copy_n(kv.v.begin() + (h * 40 + s) * 16, 16, v.begin() + h * 16);
    }
    many->update_and_fetch(make_block(k.data(), 1, 2, 1, 16), make_block(v.data(), 1, 2, 1, 16));
  }
  for (std::size_t h = 0; h < 2; ++h) EXPECT_EQ(sorted_positions(one->view(), 0, h), sorted_positions(many->view(), 0, h));
}

TEST(H2O, LongPrefillUsesTwoThreadsAndMatchesSequential) {
  // 8 heads x 1500 tokens crosses the threading threshold; results must equal the per-token path.
  auto big = h2o(64, 4), ref = h2o(64, 4);
  KV kv(1, 8, 1500, 32, 11);
  big->update_and_fetch(kv.keys(), kv.values());
  for (std::size_t s = 0; s < 1500; s += 500) {
    KV part(1, 8, 500, 32, 0);
    for (std::size_t h = 0; h < 8; ++h) {
      std::copy_n(kv.k.begin() + (h * 1500 + s) * 32, 500 * 32, part.k.begin() + h * 500 * 32);
      std::copy_n(kv.v.begin() + (h * 1500 + s) * 32, 500 * 32, part.v.begin() + h * 500 * 32);
    }
    ref->update_and_fetch(part.keys(), part.values());
  }
  for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(sorted_positions(big->view(), 0, h), sorted_positions(ref->view(), 0, h));
}

TEST(H2O, BlockedPrefillScoringEqualsTheTokenByTokenPath) {
  // A call of >= 64 tokens scores them in blocks (multi-query dot products over transposed keys);
  // single-token calls take the per-token path. Same kept rows and scores (to rounding), with
  // and without a recent window and decay, from an empty cache and from one already holding rows.
  struct Case {
    int budget, sink, recent;
    double decay;
    std::size_t warm;  // tokens absorbed one by one before the long call
  };
  for (const Case c : {Case{12, 2, 0, 1.0, 0}, Case{40, 4, 8, 1.0, 0}, Case{40, 4, 8, 0.98, 25}, Case{200, 4, 16, 0.99, 70}}) {
    SCOPED_TRACE("budget " + std::to_string(c.budget) + " recent " + std::to_string(c.recent) + " warm " + std::to_string(c.warm));
    KVCacheConfig cfg = testing::config_for("h2o");
    cfg.h2o_budget = c.budget;
    cfg.h2o_n_sink = c.sink;
    cfg.evict_recent_window = c.recent;
    cfg.evict_scoring = "key_proxy";
    cfg.evict_decay = c.decay;
    auto blocked = KVCacheFactory::create(cfg), sequential = KVCacheFactory::create(cfg);
    const std::size_t H = 3, S = 300, D = 24;
    KV kv(1, H, S, D, 17);
    auto token_block = [&](std::size_t from, std::size_t count) {
      KV part(1, H, count, D, 0);
      for (std::size_t h = 0; h < H; ++h) {
        std::copy_n(kv.k.begin() + (h * S + from) * D, count * D, part.k.begin() + h * count * D);
        std::copy_n(kv.v.begin() + (h * S + from) * D, count * D, part.v.begin() + h * count * D);
      }
      return part;
    };
    for (std::size_t s = 0; s < S; ++s) {
      KV one = token_block(s, 1);
      sequential->update_and_fetch(one.keys(), one.values());
      if (s < c.warm) blocked->update_and_fetch(one.keys(), one.values());
    }
    KV rest = token_block(c.warm, S - c.warm);
    blocked->update_and_fetch(rest.keys(), rest.values());
    const auto& a = dynamic_cast<const EvictionCache&>(*blocked).core();
    const auto& b = dynamic_cast<const EvictionCache&>(*sequential).core();
    ASSERT_EQ(a.rows(), b.rows());
    for (std::size_t h = 0; h < H; ++h) {
      EXPECT_EQ(sorted_positions(blocked->view(), 0, h), sorted_positions(sequential->view(), 0, h));
      std::map<std::int64_t, float> by_position;
      for (std::size_t i = 0; i < b.rows(); ++i) by_position[b.positions(h)[i]] = b.scores(h)[i];
      for (std::size_t i = 0; i < a.rows(); ++i) {
        EXPECT_NEAR(a.scores(h)[i], by_position[a.positions(h)[i]], 1e-4f * (1.0f + by_position[a.positions(h)[i]]));
      }
    }
  }
}

TEST(H2O, DtypesAreAcceptedAndRoundedToFp16) {
  auto a = h2o(16, 2), b = h2o(16, 2);
  KV kv(1, 1, 4, 8, 1);  // values already fp16-exact
  std::vector<std::uint16_t> k16(kv.k.size()), v16(kv.v.size());
  for (std::size_t i = 0; i < k16.size(); ++i) {
    k16[i] = f32_to_fp16(kv.k[i]);
    v16[i] = f32_to_fp16(kv.v[i]);
  }
  const CacheView va = a->update_and_fetch(kv.keys(), kv.values());
  const CacheView vb = b->update_and_fetch(make_block_fp16(k16.data(), 1, 1, 4, 8), make_block_fp16(v16.data(), 1, 1, 4, 8));
  EXPECT_EQ(std::memcmp(va.key_row(0, 0, 0), vb.key_row(0, 0, 0), 4 * 8 * 2), 0);
  std::vector<std::uint16_t> kb(kv.k.size());
  for (std::size_t i = 0; i < kb.size(); ++i) kb[i] = f32_to_bf16(kv.k[i]);
  auto c = h2o(16, 2);
  const CacheView vc = c->update_and_fetch(KVBlock{kb.data(), DType::bf16, 1, 1, 4, 8}, kv.values());
  EXPECT_EQ(fp16_to_f32(vc.key_row(0, 0, 0)[0]), fp16_to_f32(f32_to_fp16(bf16_to_f32(kb[0]))));
}

TEST(H2O, BadInputIsRejectedWithoutChangingState) {
  auto cache = h2o(8, 2);
  step(*cache, 3, 8, 1, 1, 2);
  KV wrong_heads(1, 3, 1, 8, 2);
  EXPECT_THROW(cache->update_and_fetch(wrong_heads.keys(), wrong_heads.values()), InputError);
  KV kv(1, 2, 2, 8, 3);
  kv.k[5] = std::nanf("");
  try {
    cache->update_and_fetch(kv.keys(), kv.values());
    FAIL() << "NaN accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("keys[0, 0, 0, :]"), std::string::npos) << e.what();
  }
  kv.k[5] = 1e6f;  // overflows fp16
  EXPECT_THROW(cache->update_and_fetch(kv.keys(), kv.values()), InputError);
  kv.k[5] = 0.0f;
  const std::int64_t backwards[2] = {1, 2};  // position 1 was already seen
  EXPECT_THROW(cache->update_and_fetch(kv.keys(), kv.values(), backwards), InputError);
  const std::int64_t too_few[1] = {9};
  EXPECT_THROW(cache->update_and_fetch(kv.keys(), kv.values(), too_few), InputError);
  KV empty(1, 2, 0, 8, 1);
  EXPECT_THROW(cache->update_and_fetch(empty.keys(), empty.values()), InputError);
  EXPECT_EQ(cache->stats().tokens_seen, 3u);
  EXPECT_EQ(cache->view().tokens, 3u);
  const CacheView v = cache->update_and_fetch(kv.keys(), kv.values());  // still usable
  EXPECT_EQ(v.tokens, 5u);
  EXPECT_EQ(sorted_positions(v).back(), 4);
}

TEST(H2O, ResetForgetsEverything) {
  auto cache = h2o(8, 2);
  step(*cache, 20, 8, 1);
  cache->reset();
  EXPECT_EQ(cache->view().tokens, 0u);
  EXPECT_EQ(cache->stats().tokens_seen, 0u);
  EXPECT_EQ(cache->stats().resident_bytes, 0u);
  const CacheView v = step(*cache, 2, 16, 2, 1, 3);  // a new shape is fine after reset
  EXPECT_EQ(v.heads, 3u);
  EXPECT_EQ(sorted_positions(v), (std::vector<std::int64_t>{0, 1}));
}

// The real-attention scorer: the engine reports what each query gave each row of the view.
TEST(H2OAttention, EvictsTheRowsThatGotTheLeastAttention) {
  auto cache = h2o(4, 1, 0, "attention");
  EXPECT_TRUE(cache->needs().attention);
  CacheView v = step(*cache, 6, 8, 1);
  ASSERT_EQ(v.tokens, 6u);  // attention scoring appends first, evicts after observing
  // One query; give weight by position: position 2 and 4 get the least.
  std::vector<float> probs(6);
  for (std::size_t i = 0; i < 6; ++i) {
    const std::int64_t p = v.position(0, 0, i);
    probs[i] = (p == 2 || p == 4) ? 0.01f : 0.2f;
  }
  AttentionObservation obs{probs.data(), 1, 1, 1, 6, 6, {}};
  cache->observe_attention(obs);
  EXPECT_EQ(sorted_positions(cache->view()), (std::vector<std::int64_t>{0, 1, 3, 5}));
}

TEST(H2OAttention, PrefillAllocationShrinksToTheBudgetAfterEviction) {
  auto cache = h2o(8, 2, 0, "attention");
  CacheView v = step(*cache, 100, 16, 1);
  std::vector<float> probs(v.tokens, 1.0f / v.tokens);
  cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 1, v.tokens, v.tokens, {}});
  const std::size_t per_row = 16 * 2 * 2 + 4 + 8;  // fp16 K+V, score, position
  EXPECT_EQ(cache->view().tokens, 8u);
  EXPECT_LE(cache->stats().resident_bytes, 9 * per_row);  // budget + the row a decode step appends
  for (unsigned s = 0; s < 20; ++s) {  // decode: append one, observe, evict one; no regrowth
    v = step(*cache, 1, 16, 10 + s);
    probs.assign(v.tokens, 1.0f / v.tokens);
    cache->observe_attention(AttentionObservation{probs.data(), 1, 1, 1, v.tokens, v.tokens, {}});
    EXPECT_LE(cache->stats().resident_bytes, 9 * per_row);
  }
}

TEST(H2OAttention, NormalizedScoreDividesByExposure) {
  auto cache = h2o(3, 0, 0, "attention_normalized");
  CacheView v = step(*cache, 4, 8, 1);
  // Four causal queries (positions 0..3); row p is seen by 4 - p of them. Totals: 1.0, 0.36, 0.7,
  // 0.3 (un-normalised, position 3 would go); means: 0.25, 0.12, 0.35, 0.3.
  std::vector<float> probs(4 * 4, 0.0f);
  const std::int64_t qpos[4] = {0, 1, 2, 3};
  for (std::size_t q = 0; q < 4; ++q) {
    for (std::size_t i = 0; i < 4; ++i) {
      const std::int64_t p = v.position(0, 0, i);
      if (p > qpos[q]) continue;
      probs[q * 4 + i] = p == 0 ? 0.25f : p == 3 ? 0.3f : p == 1 ? 0.12f : 0.35f;
    }
  }
  AttentionObservation obs{probs.data(), 1, 1, 4, 4, 4, std::span<const std::int64_t>(qpos, 4)};
  cache->observe_attention(obs);
  EXPECT_EQ(sorted_positions(cache->view()), (std::vector<std::int64_t>{0, 2, 3}));
  AttentionObservation bad{probs.data(), 1, 2, 4, 4, 4, {}};
  EXPECT_THROW(cache->observe_attention(bad), InputError);
}

TEST(H2O, HundredThousandRandomStepsKeepEveryInvariant) {
  for (const std::string scoring : {"key_proxy", "attention_normalized"}) {
    auto cache = h2o(24, 3, 5, scoring);
    std::mt19937 rng(17);
    std::int64_t next = 0;
    std::set<std::int64_t> sinks;
    const std::size_t steps = 100000;
    std::vector<float> probs;
    for (std::size_t step_i = 0; step_i < steps; ++step_i) {
      const std::size_t S = (rng() % 16 == 0) ? 1 + rng() % 7 : 1;
      KV kv(1, 2, S, 8, static_cast<unsigned>(step_i));
      std::vector<std::int64_t> pos(S);
      for (auto& p : pos) p = next++;
      CacheView v = cache->update_and_fetch(kv.keys(), kv.values(), pos);
      if (cache->needs().attention) {
        probs.assign(2 * S * v.tokens, 0.0f);
        for (std::size_t i = 0; i < probs.size(); ++i) probs[i] = float(rng() % 1000) / 1000.0f / v.tokens;
        cache->observe_attention(AttentionObservation{probs.data(), 1, 2, S, v.tokens, v.tokens, pos});
        v = cache->view();
      }
      ASSERT_LE(v.tokens, 24u);
      ASSERT_EQ(v.tokens, std::min<std::size_t>(next, 24));
      auto* e = dynamic_cast<const EvictionCache*>(cache.get());
      for (std::size_t h = 0; h < 2; ++h) {
        const auto sp = sorted_positions(v, 0, h);
        ASSERT_TRUE(std::adjacent_find(sp.begin(), sp.end()) == sp.end());  // no duplicates
        for (std::int64_t s = 0; s < std::min<std::int64_t>(3, next); ++s) ASSERT_EQ(sp[s], s);  // sinks
        for (std::int64_t r = std::max<std::int64_t>(0, next - 5); r < next; ++r) {
          ASSERT_TRUE(std::binary_search(sp.begin(), sp.end(), r));  // recent window
        }
        for (std::size_t i = 0; i < v.tokens; ++i) ASSERT_GE(e->core().scores(h)[i], 0.0f);
      }
    }
  }
}

}  // namespace
}  // namespace kvslim
