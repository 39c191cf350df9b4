// Issue 26, item 8: observe_attention / observe_hidden reject NaN and infinite observations at the
// call, as append rejects non-finite keys, and change nothing then. They used to be accepted: a
// squeeze set then kept 3-4x its budget, or a layer starved, and the error surfaced from another
// layer's call.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvslim/kvslim.h"
#include "test_util.h"

namespace kvslim {
namespace {

using testing::KV;

constexpr float kBad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};

// Configs whose caches read the attention observation.
std::vector<std::pair<std::string, KVCacheConfig>> attention_readers() {
  std::vector<std::pair<std::string, KVCacheConfig>> out;
  for (const char* method : {"h2o", "pyramidkv", "squeeze"}) {
    KVCacheConfig c = testing::config_for(method);
    c.evict_scoring = "attention";
    out.emplace_back(std::string(method) + "/attention", c);
  }
  KVCacheConfig z = testing::config_for("zipcache");
  z.zipcache_saliency = "attention_normalized";
  out.emplace_back("zipcache/attention_normalized", z);
  KVCacheConfig sq = testing::config_for("squeeze");
  sq.squeeze_signal = "attention_entropy";
  out.emplace_back("squeeze/attention_entropy", sq);
  return out;
}

TEST(ObservationCheck, NonFiniteAttentionIsRefusedAtTheCall) {
  for (const auto& [name, config] : attention_readers()) {
    for (float bad : kBad) {
      SCOPED_TRACE(name + " " + std::to_string(bad));
      CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 1, 8), config);
      KVCache& cache = set.at(0);
      ASSERT_TRUE(cache.needs().attention) << name;
      const KV kv(1, 1, 40, 8, 3);
      const CacheView v = cache.update_and_fetch(kv.keys(), kv.values());
      std::vector<float> probs(v.tokens, 1.0f / static_cast<float>(v.tokens));
      probs[v.tokens / 2] = bad;
      const std::int64_t qpos = 39;
      const CacheStats before = cache.stats();
      try {
        cache.observe_attention(AttentionObservation{probs.data(), 1, 1, 1, v.tokens, v.tokens, {&qpos, 1}});
        ADD_FAILURE() << "expected InputError";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("NaN or infinite"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("token " + std::to_string(v.tokens / 2)), std::string::npos) << e.what();
      }
      const CacheStats after = cache.stats();
      EXPECT_EQ(after.tokens_kept, before.tokens_kept);
      EXPECT_EQ(after.tokens_seen, before.tokens_seen);
      // The same observation with finite values is taken.
      probs[v.tokens / 2] = 0.0f;
      EXPECT_NO_THROW(cache.observe_attention(AttentionObservation{probs.data(), 1, 1, 1, v.tokens, v.tokens, {&qpos, 1}}));
    }
  }
}

TEST(ObservationCheck, NonFiniteHiddenStatesAreRefusedAtTheCall) {
  KVCacheConfig c = testing::config_for("squeeze");
  c.squeeze_signal = "hidden_cosine";
  for (float bad : kBad) {
    for (int which = 0; which < 2; ++which) {
      CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(2, 1, 8), c);
      ASSERT_TRUE(set.at(0).needs().hidden_states);
      const KV kv(1, 1, 40, 8, 5);
      set.at(0).update_and_fetch(kv.keys(), kv.values());
      std::vector<float> before(4 * 6, 0.5f), after(4 * 6, 0.25f);
      (which == 0 ? before : after)[13] = bad;
      try {
        set.at(0).observe_hidden(HiddenObservation{before.data(), after.data(), 1, 4, 6});
        ADD_FAILURE() << "expected InputError";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find(which == 0 ? "before" : "after"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("token 2, dimension 1"), std::string::npos) << e.what();
      }
      // Nothing was reported to the coordinator: the finite observation still is taken.
      (which == 0 ? before : after)[13] = 0.5f;
      EXPECT_NO_THROW(set.at(0).observe_hidden(HiddenObservation{before.data(), after.data(), 1, 4, 6}));
    }
  }
}

}  // namespace
}  // namespace kvslim
