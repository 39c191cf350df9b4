// The tee cache behind `bench engine --shared-prefill`: a follower fed by one shared prefill ends
// where its own prefill of the same prompt (one call into an empty cache) ends.
#include "engine/tee_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "engine/model.h"
#include "engine/random_model.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;

class TeeCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvslim_tee_test_" + std::to_string(getpid()));
    write_random_model(dir_, RandomModelSpec{.num_layers = 3, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16}, /*force=*/true);
    model_ = std::make_unique<Model>(Model::load(dir_));
    for (int i = 0; i < 96; ++i) prompt_.push_back((i * 37 + 11) % model_->config().vocab_size);
  }
  void TearDown() override { fs::remove_all(dir_); }

  CacheSet caches(const std::string& method, std::vector<std::pair<std::string, std::string>> settings = {}) const {
    KVCacheConfig cfg;
    cfg.method = method;
    for (auto& [k, v] : settings) cfg.set(k, v);
    return KVCacheBuilder::for_model(model_->cache_spec(), cfg);
  }
  void prefill(CacheSet& set) const {
    Transformer t(*model_, set, {.threads = 1, .max_chunk = prompt_.size()});
    t.prefill(prompt_);
  }
  // One decode step after the prompt, by a Transformer of its own (as the bench decodes each set):
  // squeeze layers apply the schedule their set finalised at this call.
  void decode_once(CacheSet& set) const {
    Transformer t(*model_, set, {.threads = 1});
    const int token = 5;
    const std::int64_t pos = static_cast<std::int64_t>(prompt_.size());
    t.forward(std::span<const int>(&token, 1), std::span<const std::int64_t>(&pos, 1));
  }

  fs::path dir_;
  std::unique_ptr<Model> model_;
  std::vector<int> prompt_;
};

// Rows, positions and bits of every layer.
void expect_same_state(const CacheSet& a, const CacheSet& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t l = 0; l < a.size(); ++l) {
    const CacheView x = a.at(l).materialize(), y = b.at(l).materialize();
    ASSERT_EQ(x.tokens, y.tokens) << what << " layer " << l;
    for (std::size_t h = 0; h < x.heads; ++h) {
      for (std::size_t i = 0; i < x.tokens; ++i) {
        ASSERT_EQ(x.position(0, h, i), y.position(0, h, i)) << what << " layer " << l << " head " << h << " row " << i;
        for (std::size_t j = 0; j < x.head_dim; ++j) {
          ASSERT_EQ(x.key_row(0, h, i)[j], y.key_row(0, h, i)[j]) << what << " layer " << l;
          ASSERT_EQ(x.value_row(0, h, i)[j], y.value_row(0, h, i)[j]) << what << " layer " << l;
        }
      }
    }
  }
}

TEST_F(TeeCacheTest, AnEvictingFollowerEndsAsItsOwnPrefillLeavesIt) {
  // h2o attends over every prompt row before it evicts, so the shared prefill (attention over the
  // full cache's rows) is its own prefill: same kept rows, same bits -- in every layer.
  for (const auto& [method, settings] :
       std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>>{
           {"h2o", {{"h2o_budget", "40"}}},
           {"squeeze", {{"squeeze_budget", "40"}}}}) {
    CacheSet full = caches("full"), follower = caches(method, settings), alone = caches(method, settings);
    CacheSet tee = tee_cache_set(full, {&follower});
    prefill(tee);
    prefill(alone);
    expect_same_state(follower, alone, method + " after the prompt");
    decode_once(follower);
    decode_once(alone);
    expect_same_state(follower, alone, method + " after a decode step");
    EXPECT_EQ(follower.resident_bytes(), alone.resident_bytes()) << method;
    EXPECT_LT(follower.at(0).rows(), full.at(0).rows()) << method << ": the budget did not bind";
  }
}

TEST_F(TeeCacheTest, ACompressedOrWindowedFollowerMatchesItsOwnPrefillInTheFirstLayer) {
  // kivi's own prefill attends over its dequantised rows, streaming's over the window it keeps
  // after the append, so their later layers see other hidden states than the shared prefill's;
  // the first layer's keys and values depend on the embeddings alone.
  for (const auto& [method, settings] : std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>>{
           {"kivi", {}}, {"streaming", {{"streaming_budget", "40"}}}}) {
    CacheSet full = caches("full"), follower = caches(method, settings), alone = caches(method, settings);
    CacheSet tee = tee_cache_set(full, {&follower});
    prefill(tee);
    prefill(alone);
    const CacheView x = follower.at(0).materialize(), y = alone.at(0).materialize();
    ASSERT_EQ(x.tokens, y.tokens) << method;
    for (std::size_t h = 0; h < x.heads; ++h) {
      for (std::size_t i = 0; i < x.tokens; ++i) {
        ASSERT_EQ(x.position(0, h, i), y.position(0, h, i)) << method;
        for (std::size_t j = 0; j < x.head_dim; ++j) {
          ASSERT_EQ(x.key_row(0, h, i)[j], y.key_row(0, h, i)[j]) << method;
          ASSERT_EQ(x.value_row(0, h, i)[j], y.value_row(0, h, i)[j]) << method;
        }
      }
    }
    EXPECT_EQ(follower.resident_bytes(), alone.resident_bytes()) << method;
    EXPECT_EQ(full.at(0).rows(), prompt_.size());
  }
}

TEST_F(TeeCacheTest, NeedsAreTheUnionAndARowMismatchIsRefused) {
  CacheSet full = caches("full"), h2o = caches("h2o", {{"h2o_budget", "40"}});
  CacheSet tee = tee_cache_set(full, {&h2o});
  const ObservationNeeds n = tee.at(0).needs();
  EXPECT_TRUE(n.attention);
  EXPECT_EQ(n.attention_queries, h2o.at(0).needs().attention_queries);
  // A second prompt call: h2o now keeps fewer rows than full, so the observation (over full's
  // rows) cannot be its own.
  prefill(tee);
  Transformer t(*model_, tee, {.threads = 1, .max_chunk = prompt_.size()});
  std::vector<std::int64_t> pos(prompt_.size());
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int64_t>(prompt_.size() + i);
  EXPECT_THROW(t.forward(prompt_, pos, false, true), std::logic_error);
  EXPECT_THROW(tee_cache_set(full, {nullptr}), std::invalid_argument);
}

}  // namespace
}  // namespace kvslim::engine
