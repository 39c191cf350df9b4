#include "engine/eval/retrieval.h"

#include <gtest/gtest.h>

#include "eval_test_util.h"

namespace kvslim::engine::eval {
namespace {

using testing::byte_decode;
using testing::byte_encode;
using testing::filler_lines;
using testing::kBos;

EpisodeMaker maker() { return EpisodeMaker(byte_encode, kBos, filler_lines()); }

TEST(EvalRetrieval, PasskeyNeedleSitsAtTheRequestedDepth) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(3);
  for (double depth : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    const Episode e = m.passkey(1200, depth, rng);
    EXPECT_EQ(e.task, "passkey");
    EXPECT_EQ(e.prompt[0], kBos);
    // The last filler line is cut at a word: a byte encoder leaves up to one word of slack.
    EXPECT_NEAR(static_cast<double>(e.length()), 1200.0, 12.0);
    // Lines are ~80 bytes in ~1000 bytes of filler: the nearest boundary is within 0.05.
    EXPECT_NEAR(e.depth, depth, 0.05) << "depth " << depth;
    const std::string needle = "The pass key is " + e.answer_text + ". Remember it.";
    EXPECT_EQ(byte_decode(e.prompt, e.needle_token, needle.size()), needle);
    EXPECT_EQ(e.answer_text.size(), 5u);
    EXPECT_EQ(e.answer, byte_encode(" " + e.answer_text));
    EXPECT_NE(e.text.find(std::string(EpisodeTemplates::kPasskeyQuestion)), std::string::npos);
    EXPECT_EQ(e.text.size() - e.text.rfind("What is the pass key?"), EpisodeTemplates::kPasskeyQuestion.size());
  }
}

TEST(EvalRetrieval, KvListQueriesThePairAtDepth) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(5);
  for (double depth : {0.0, 0.5, 1.0}) {
    const Episode e = m.kvlist(600, depth, rng);
    EXPECT_LE(e.length(), 600u);
    EXPECT_NEAR(e.depth, depth, 0.06);
    // The queried line is "key: value" and the question names the same key.
    const std::string line = byte_decode(e.prompt, e.needle_token, 14);
    EXPECT_EQ(line.substr(6, 2), ": ");
    EXPECT_EQ(line.substr(8, 5), e.answer_text);
    EXPECT_NE(e.text.rfind("What is the value of key " + line.substr(0, 6) + "?"), std::string::npos);
  }
}

TEST(EvalRetrieval, ExactMatchOnly) {
  const std::vector<int> answer = {32, 49, 50, 51};
  EXPECT_TRUE(answer_matches(std::vector<int>{32, 49, 50, 51}, answer));
  EXPECT_FALSE(answer_matches(std::vector<int>{32, 49, 50}, answer));          // short
  EXPECT_FALSE(answer_matches(std::vector<int>{32, 49, 50, 51, 52}, answer));  // long
  EXPECT_FALSE(answer_matches(std::vector<int>{32, 49, 50, 52}, answer));      // one digit off
  EXPECT_FALSE(answer_matches(std::vector<int>{}, std::vector<int>{}));        // nothing to match
}

TEST(EvalRetrieval, BadRequestsAreRejected) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(1);
  EXPECT_THROW(m.passkey(1000, 1.5, rng), std::invalid_argument);
  EXPECT_THROW(m.passkey(50, 0.5, rng), std::invalid_argument);  // the template alone is longer
  EXPECT_THROW(EpisodeMaker(byte_encode, kBos, {"", "  "}), std::invalid_argument);
  EXPECT_EQ(fill_template("{key} and {key}", "key", "7"), "7 and 7");
}

TEST(EvalRetrieval, GreedyAnswerStopsAtTheFirstWrongToken) {
  const Model& model = testing::small_model();
  KVCacheConfig full;
  full.method = "full";
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), full);
  ForwardOptions fo;
  fo.threads = 1;
  Transformer t(model, caches, fo);
  std::mt19937_64 rng(9);
  const Episode e = maker().passkey(300, 0.5, rng);
  const std::vector<int> got = greedy_answer(t, e);
  ASSERT_FALSE(got.empty());
  EXPECT_LE(got.size(), e.answer.size());
  for (std::size_t i = 0; i + 1 < got.size(); ++i) EXPECT_EQ(got[i], e.answer[i]);
  EXPECT_EQ(answer_matches(got, e.answer), got == e.answer);
}

}  // namespace
}  // namespace kvslim::engine::eval
