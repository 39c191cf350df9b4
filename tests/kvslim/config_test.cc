// KVCacheConfig defaults, validation at construction (every field named), text access, and the
// factory/builder contract for every method.
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvslim {
namespace {

TEST(Config, OriginalDefaults) {
  const KVCacheConfig c;
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.squeeze_budget, 512);
  EXPECT_EQ(c.squeeze_n_sink, 4);
  EXPECT_EQ(c.squeeze_strength, 1.0);
  EXPECT_FALSE(c.squeeze_resolved_budget.has_value());
  EXPECT_EQ(c.h2o_budget, 512);
  EXPECT_EQ(c.h2o_n_sink, 4);
  EXPECT_EQ(c.zipcache_hi_bits, 4);
  EXPECT_EQ(c.zipcache_lo_bits, 2);
  // zipcache's split was re-chosen with the later question in view (issue 27: the seed's 0.2 / 32
  // kept kvlist after the context at 0.78, this 0.88 at 10 % fewer bytes; docs/results.md).
  EXPECT_EQ(c.zipcache_hi_fraction, 0.5);
  EXPECT_EQ(c.zipcache_group_size, 128);
  EXPECT_TRUE(c.zipcache_quantize_values);
  EXPECT_NO_THROW(c.validate());
}

// Each invalid value must be rejected with a ConfigError that names the field.
TEST(Config, EveryInvalidFieldIsRejectedByName) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"method", "turboquant_rvq"},
      {"head_dim", "0"},
      {"squeeze_budget", "0"},
      {"squeeze_budget", "4"},  // == n_sink
      {"squeeze_n_sink", "-1"},
      {"squeeze_n_sink", "600"},
      {"squeeze_strength", "1.5"},
      {"squeeze_strength", "-0.1"},
      {"squeeze_strength", "nan"},
      {"squeeze_resolved_budget", "3"},
      {"squeeze_prefill", "lazy"},
      {"squeeze_signal", "attention_map"},
      {"squeeze_concentration_heads", "some"},
      {"h2o_budget", "-5"},
      {"h2o_n_sink", "512"},
      {"pyramidkv_budget", "2"},
      {"pyramidkv_beta", "0.5"},
      {"evict_recent_window", "-2"},
      {"evict_profile", "newest"},
      {"evict_obs_window", "-3"},
      {"evict_pool_kernel", "4"},
      {"evict_decay", "1.5"},
      {"evict_scoring", "random"},
      {"streaming_budget", "4"},
      {"streaming_n_sink", "-2"},
      {"zipcache_hi_bits", "9"},
      {"zipcache_hi_bits", "0"},
      {"zipcache_lo_bits", "5"},  // > hi_bits
      {"zipcache_hi_fraction", "1.01"},
      {"zipcache_group_size", "0"},
      {"zipcache_staging", "-32"},
      {"zipcache_saliency", "attention"},
      {"kivi_bits", "0"},
      {"kivi_group_size", "-1"},
      {"kivi_staging", "7"},
  };
  for (const auto& [field, value] : bad) {
    KVCacheConfig c;
    c.set(field, value);
    try {
      c.validate();
      ADD_FAILURE() << field << " = " << value << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  }
  // A zipcache window of whole groups (the zipcache fields bind a zipcache cache or storage only).
  KVCacheConfig z;
  z.method = "zipcache";
  z.zipcache_group_size = 32;
  z.zipcache_staging = 48;
  EXPECT_THROW(z.validate(), ConfigError);
  z.method = "h2o";
  EXPECT_NO_THROW(z.validate());
  z.storage = "zipcache";
  EXPECT_THROW(z.validate(), ConfigError);
}

TEST(Config, RecentWindowMustLeaveRoomToEvict) {
  KVCacheConfig c = testing::config_for("h2o");
  c.h2o_budget = 8;
  c.h2o_n_sink = 4;
  c.evict_recent_window = 4;
  EXPECT_THROW(c.validate(), ConfigError);
  c.evict_recent_window = 3;
  EXPECT_NO_THROW(c.validate());
}

TEST(Config, FactoryAndBuilderValidateBeforeBuilding) {
  KVCacheConfig c = testing::config_for("squeeze");
  c.squeeze_strength = 2.0;  // the original raises only when the coordinator finalises, mid-forward
  EXPECT_THROW(KVCacheFactory::create(c), ConfigError);
  EXPECT_THROW(KVCacheBuilder::for_model(ModelSpec::uniform(4, 2, 64), c), ConfigError);
  c.squeeze_strength = 0.5;
  c.squeeze_n_sink = c.squeeze_budget;  // the original raises on the first update
  EXPECT_THROW(KVCacheFactory::create(c), ConfigError);
  ModelSpec bad = ModelSpec::uniform(2, 2, 64);
  bad.layers[1].kv_heads = 0;
  EXPECT_THROW(KVCacheBuilder::for_model(bad, testing::config_for("h2o")), ConfigError);
}

TEST(Config, SetParsesAndRejectsText) {
  KVCacheConfig c;
  c.set("squeeze_strength", "0.25");
  c.set("h2o_budget", "77");
  c.set("zipcache_quantize_values", "false");
  c.set("squeeze_resolved_budget", "9");
  c.set("method", "h2o");
  EXPECT_EQ(c.squeeze_strength, 0.25);
  EXPECT_EQ(c.h2o_budget, 77);
  EXPECT_FALSE(c.zipcache_quantize_values);
  EXPECT_EQ(c.squeeze_resolved_budget, 9);
  c.set("squeeze_resolved_budget", "none");
  EXPECT_FALSE(c.squeeze_resolved_budget.has_value());
  EXPECT_THROW(c.set("h2o_budget", "12x"), ConfigError);
  EXPECT_THROW(c.set("h2o_budget", ""), ConfigError);
  EXPECT_THROW(c.set("squeeze_strength", "much"), ConfigError);
  EXPECT_THROW(c.set("zipcache_quantize_values", "maybe"), ConfigError);
  EXPECT_THROW(c.set("no_such_field", "1"), ConfigError);
  bool found = false;
  for (const auto& [name, value] : c.fields()) found = found || (name == "h2o_budget" && value == "77");
  EXPECT_TRUE(found);
}

TEST(Factory, BuildsEveryMethod) {
  for (const auto& m : method_names()) {
    KVCacheConfig c = testing::config_for(m);
    auto cache = KVCacheFactory::create(c);
    ASSERT_NE(cache, nullptr) << m;
    EXPECT_EQ(cache->method(), m);
    const testing::KV kv(1, 2, 40, 64, 1);
    const CacheView v = cache->update_and_fetch(kv.keys(), kv.values());
    EXPECT_EQ(v.tokens, 40u) << m;  // every default budget is above 40 tokens
    EXPECT_EQ(cache->stats().tokens_seen, 40u) << m;
  }
}

TEST(Factory, ForModelPropagatesHeadDimAndSeedPerLayer) {
  ModelSpec spec;
  spec.layers = {{true, 2, 64}, {true, 4, 32}};
  for (const auto& m : method_names()) {
    CacheSet set = KVCacheBuilder::for_model(spec, testing::config_for(m));
    ASSERT_EQ(set.size(), 2u);
    const testing::KV a(1, 2, 5, 64, 1), b(1, 4, 5, 32, 2);
    EXPECT_EQ(set.at(0).update_and_fetch(a.keys(), a.values()).head_dim, 64u) << m;
    EXPECT_EQ(set.at(1).update_and_fetch(b.keys(), b.values()).head_dim, 32u) << m;
    EXPECT_GT(set.resident_bytes(), 0u);
    EXPECT_EQ(set.seen_fp16_bytes(), 5u * (2 * 64 + 4 * 32) * 4);
  }
}

TEST(Streaming, KeepsSinksAndTheRecentWindow) {
  KVCacheConfig c = testing::config_for("streaming");
  c.streaming_budget = 10;
  c.streaming_n_sink = 4;
  auto cache = KVCacheFactory::create(c);
  for (unsigned s = 0; s < 50; ++s) {
    const testing::KV kv(1, 1, 1, 8, s);
    cache->update_and_fetch(kv.keys(), kv.values());
  }
  EXPECT_EQ(testing::sorted_positions(cache->view()), (std::vector<std::int64_t>{0, 1, 2, 3, 44, 45, 46, 47, 48, 49}));
  const testing::KV block(1, 1, 30, 8, 3);
  cache->update_and_fetch(block.keys(), block.values());
  EXPECT_EQ(testing::sorted_positions(cache->view()), (std::vector<std::int64_t>{0, 1, 2, 3, 74, 75, 76, 77, 78, 79}));
}

TEST(Full, KeepsEverythingAndGrowsGeometrically) {
  auto cache = KVCacheFactory::create(testing::config_for("full"));
  for (unsigned s = 0; s < 300; ++s) {
    const testing::KV kv(1, 2, 1, 16, s);
    cache->update_and_fetch(kv.keys(), kv.values());
  }
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.tokens_kept, 300u);
  EXPECT_EQ(st.kept_fp16_bytes, st.seen_fp16_bytes);
  EXPECT_LE(st.resident_bytes, 2 * 512u * 2 * (16 * 4 + 12));  // at most one doubling of slack
}

}  // namespace
}  // namespace kvslim

namespace kvslim {
namespace {

// Issue 26, item 9: float fields read back with 6 significant digits (evict_decay = 0.9999999
// came back as 1, i.e. no decay, in fields(), a round trip and eval's JSON).
TEST(ConfigIssue26, FloatFieldsRoundTripExactly) {
  KVCacheConfig c;
  c.set("evict_decay", "0.9999999");
  c.set("zipcache_hi_fraction", "0.123456789012345");
  c.set("squeeze_strength", "0.30000000000000004");
  KVCacheConfig back;
  for (const auto& [field, text] : c.fields()) back.set(field, text);
  EXPECT_EQ(back.evict_decay, 0.9999999);
  EXPECT_EQ(back.zipcache_hi_fraction, 0.123456789012345);
  EXPECT_EQ(back.squeeze_strength, 0.30000000000000004);
  for (const auto& [field, text] : c.fields()) {
    if (field == "evict_decay") {
      EXPECT_EQ(text, "0.9999999");
    }
  }
}

}  // namespace
}  // namespace kvslim
