// Positions past max_position_embeddings (issue 13, item 8): refused by default with an error
// that names the limit, before any work; run when the caller allows it explicitly. Positions
// never wrap past INT64_MAX (item 10).
#include <gtest/gtest.h>

#include <limits>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

using testing::TempDir;

class ContextLength : public ::testing::Test {
 protected:
  void SetUp() override {
    write_random_model(dir_.path(), RandomModelSpec{.num_layers = 1, .vocab_size = 40, .max_position_embeddings = 16});
  }
  static std::vector<int> tokens(std::size_t n) {
    std::vector<int> t(n);
    for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<int>((i * 7 + 3) % 40);
    return t;
  }
  static void expect_refused(const std::function<void()>& fn, const std::string& fragment) {
    try {
      fn();
      ADD_FAILURE() << "expected ContextLengthError";
    } catch (const ContextLengthError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("max_position_embeddings 16"), std::string::npos) << msg;
      EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
      EXPECT_NE(msg.find("allow"), std::string::npos) << msg;
    }
  }
  TempDir dir_;
};

TEST_F(ContextLength, PromptPastTheLimitIsRefusedBeforeAnyChunkRuns) {
  const Model model = Model::load(dir_.path());
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), KVCacheConfig{});
  Transformer t(model, caches, {.prefill_chunk = 4});
  const auto prompt = tokens(17);  // positions 0..16; 16 is the first one past the limit
  expect_refused([&] { t.prefill(prompt); }, "prompt of 17 tokens reaches position 16");
  EXPECT_EQ(t.next_position(), 0);
  EXPECT_EQ(caches.at(0).stats().tokens_seen, 0u);
  t.prefill(tokens(16));  // exactly the limit is fine
  EXPECT_EQ(t.next_position(), 16);
  expect_refused([&] { t.decode(1); }, "reaches position 16");
}

TEST_F(ContextLength, GenerationPastTheLimitIsRefusedUpFront) {
  const Model model = Model::load(dir_.path());
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), KVCacheConfig{});
  Transformer t(model, caches);
  // 10 prompt tokens + 8 new ones: the 7 fed back reach position 16.
  expect_refused([&] { generate_tokens(t, tokens(10), GenerateOptions{.max_tokens = 8}); },
                 "prompt of 10 tokens + max_tokens 8 reaches position 16");
  EXPECT_EQ(t.next_position(), 0);  // nothing ran
  const auto r = generate_tokens(t, tokens(10), GenerateOptions{.max_tokens = 7});
  EXPECT_EQ(r.generated_ids.size(), 7u);
  EXPECT_EQ(t.next_position(), 16);
}

TEST_F(ContextLength, AllowedExplicitly) {
  const Model model = Model::load(dir_.path());
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), KVCacheConfig{});
  Transformer t(model, caches, {.allow_past_max_positions = true});
  const auto r = generate_tokens(t, tokens(20), GenerateOptions{.max_tokens = 10});
  EXPECT_EQ(r.generated_ids.size(), 10u);
  EXPECT_EQ(t.next_position(), 29);
}

TEST_F(ContextLength, PositionsNeverWrapPastInt64Max) {
  const Model model = Model::load(dir_.path());
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), KVCacheConfig{});
  Transformer t(model, caches, {.allow_past_max_positions = true});
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::vector<int> one = {5};
  const std::vector<std::int64_t> at_max = {kMax};
  EXPECT_THROW(t.forward(one, at_max), std::invalid_argument);
  const std::vector<std::int64_t> below_max = {kMax - 1};
  t.forward(one, below_max);
  EXPECT_EQ(t.next_position(), kMax);
  EXPECT_THROW(t.decode(5), std::invalid_argument);  // would run at INT64_MAX, then wrap
  EXPECT_THROW(t.prefill(tokens(2)), std::invalid_argument);
  EXPECT_EQ(t.next_position(), kMax);
}

}  // namespace
}  // namespace kvslim::engine
