// The question after the compressed context (issue 27): the document is prefilled and compressed
// in its own call, the question comes in a later one; multikey episodes; the multi-turn run.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "engine/eval/evaluator.h"
#include "engine/eval/retrieval.h"
#include "eval_test_util.h"

namespace kvslim::engine::eval {
namespace {

using testing::byte_decode;
using testing::byte_encode;
using testing::filler_lines;
using testing::kBos;

EpisodeMaker maker() { return EpisodeMaker(byte_encode, kBos, filler_lines()); }

struct CachedModel {
  CacheSet caches;
  Transformer transformer;
  CachedModel(const KVCacheConfig& config, std::size_t tokens)
      : caches(KVCacheBuilder::for_model(testing::small_model().cache_spec(), config)),
        transformer(testing::small_model(), caches, options(tokens)) {}
  static ForwardOptions options(std::size_t tokens) {
    ForwardOptions fo;
    fo.threads = 1;
    fo.max_chunk = tokens;
    fo.max_context = tokens;
    return fo;
  }
};

KVCacheConfig method(const std::string& name, int budget = 0) {
  KVCacheConfig c;
  c.method = name;
  if (name == "h2o") c.h2o_budget = budget;
  return c;
}

// The full cache's own greedy continuation of the whole prompt (n tokens, no early stop).
std::vector<int> full_continuation(const std::vector<int>& prompt, std::size_t n) {
  CachedModel r(method("full"), prompt.size() + n);
  std::vector<int> out;
  std::span<const float> logits = r.transformer.prefill(prompt);
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    logits = r.transformer.decode(out.back());
  }
  return out;
}

TEST(EvalLaterQuestion, TheQuestionStartsAtATokenBoundaryOfTheSameTokens) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(4);
  for (const std::string task : {"passkey", "kvlist", "multikey"}) {
    const Episode e = m.make(task, 700, 0.5, rng);
    ASSERT_GT(e.question_start, 1u) << task;
    ASSERT_LT(e.question_start, e.prompt.size()) << task;
    const std::string question = byte_decode(e.prompt, e.question_start, e.prompt.size() - e.question_start);
    EXPECT_EQ(question.substr(0, 8), "What is ") << task;
    EXPECT_EQ(e.prompt[e.question_start - 1], '\n') << task;  // the document ends with its last line
  }
}

TEST(EvalLaterQuestion, MultikeyHidesFourCodesAndAsksTheOneAtDepth) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(8);
  for (double depth : {0.0, 0.5, 1.0}) {
    const Episode e = m.multikey(900, depth, rng);
    EXPECT_EQ(e.task, "multikey");
    EXPECT_NEAR(static_cast<double>(e.length()), 900.0, 16.0);
    EXPECT_NEAR(e.depth, depth, 0.1) << depth;
    const std::string needle = byte_decode(e.prompt, e.needle_token, 12);
    EXPECT_EQ(needle, "The code for");
    // Four needles, four distinct codes; the queried one is in the question.
    std::set<std::string> codes;
    const std::string document = e.text.substr(0, e.text.rfind("What is the code"));
    for (std::size_t at = document.find("The code for the "); at != std::string::npos; at = document.find("The code for the ", at + 1)) {
      const std::size_t is = document.find(" is ", at);
      codes.insert(document.substr(is + 4, 5));
    }
    EXPECT_EQ(codes.size(), 4u);
    EXPECT_TRUE(codes.count(e.answer_text));
    ASSERT_EQ(e.follow_ups.size(), 3u);
    for (const auto& f : e.follow_ups) {
      EXPECT_TRUE(codes.count(f.answer_text)) << f.answer_text;
      EXPECT_NE(f.answer_text, e.answer_text);
      EXPECT_EQ(f.question.front(), '\n');  // the next turn starts on a new line, as in training
      EXPECT_EQ(f.answer, byte_encode(" " + f.answer_text));
    }
  }
}

TEST(EvalLaterQuestion, KvListFollowUpsAskOtherPairsOfTheList) {
  const EpisodeMaker m = maker();
  std::mt19937_64 rng(2);
  const Episode e = m.kvlist(800, 0.3, rng);
  ASSERT_EQ(e.follow_ups.size(), 3u);
  std::set<std::string> asked{e.answer_text};
  for (const auto& f : e.follow_ups) {
    const std::string q = byte_decode(f.question, 0, f.question.size());
    const std::string key = q.substr(std::string("\nWhat is the value of key ").size(), 6);
    EXPECT_NE(e.text.find(key + ": " + f.answer_text + "\n"), std::string::npos) << key;
    asked.insert(f.answer_text);
  }
  EXPECT_EQ(asked.size(), 4u);
  EXPECT_EQ(e.length_with_turns(3), e.length() + e.follow_ups[0].question.size() + e.follow_ups[0].answer.size() +
                                        e.follow_ups[1].question.size() + e.follow_ups[1].answer.size());
}

// Uncompressed, the two settings are the same computation split differently: the full cache
// answers identically. The episode's answer is set to the full cache's own continuation, so the
// test fails unless the later setting reproduces every answer token.
TEST(EvalLaterQuestion, FullCacheAnswersIdenticallyInBothSettings) {
  std::mt19937_64 rng(12);
  for (const std::string task : {"passkey", "kvlist", "multikey"}) {
    Episode e = maker().make(task, 500, 0.5, rng);
    e.answer = full_continuation(e.prompt, 5);
    CachedModel inside(method("full"), e.length()), later(method("full"), e.length());
    EXPECT_EQ(greedy_answer(inside.transformer, e), e.answer) << task;
    const LaterAnswers got = answer_later(later.transformer, e, 1);
    ASSERT_EQ(got.correct.size(), 1u);
    EXPECT_TRUE(got.correct[0]) << task;
    EXPECT_EQ(got.generated[0], e.answer) << task;
  }
}

// The point of the setting: the cache chooses what to keep before any question token exists. An
// h2o cache under its budget after the document's call, and what it kept there is the same
// whatever question follows.
TEST(EvalLaterQuestion, TheDocumentIsCompressedBeforeTheQuestionIsSeen) {
  std::mt19937_64 rng(21);
  const Episode e = maker().kvlist(600, 0.5, rng);
  Episode other = e;  // same document, another question (the first follow-up's)
  other.prompt.resize(e.question_start);
  other.prompt.insert(other.prompt.end(), e.follow_ups[0].question.begin() + 1, e.follow_ups[0].question.end());
  other.answer = e.follow_ups[0].answer;
  ASSERT_NE(std::vector<int>(other.prompt.begin() + static_cast<std::ptrdiff_t>(e.question_start), other.prompt.end()),
            std::vector<int>(e.prompt.begin() + static_cast<std::ptrdiff_t>(e.question_start), e.prompt.end()));
  const int budget = 96;
  auto kept_after_document = [&](const Episode& episode) {
    CachedModel r(method("h2o", budget), episode.length_with_turns(1));
    std::vector<std::vector<std::int64_t>> kept;
    answer_later(r.transformer, episode, 1, [&] {
      for (std::size_t l = 0; l < r.caches.size(); ++l) {
        const CacheView v = r.caches[l]->materialize();
        EXPECT_LE(v.tokens, static_cast<std::size_t>(budget)) << "layer " << l << " holds more than its budget";
        std::vector<std::int64_t> positions;
        for (std::size_t h = 0; h < v.heads; ++h) {
          for (std::size_t i = 0; i < v.tokens; ++i) positions.push_back(v.position(0, h, i));
        }
        std::sort(positions.begin(), positions.end());
        EXPECT_LT(positions.back(), static_cast<std::int64_t>(episode.question_start)) << "a question token before the question";
        kept.push_back(positions);
      }
    });
    return kept;
  };
  const auto a = kept_after_document(e), b = kept_after_document(other);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a, b);
  // Inside the prompt the question does change what h2o keeps of the document (it scores the
  // prompt by its last queries, the question's): the setting measures something else.
  auto kept_inside = [&](const Episode& episode) {
    CachedModel r(method("h2o", budget), episode.length());
    r.transformer.prefill(episode.prompt);
    std::vector<std::int64_t> positions;
    const CacheView v = r.caches[0]->materialize();
    for (std::size_t i = 0; i < v.tokens; ++i) {
      if (v.position(0, 0, i) < static_cast<std::int64_t>(episode.question_start)) positions.push_back(v.position(0, 0, i));
    }
    std::sort(positions.begin(), positions.end());
    return positions;
  };
  EXPECT_NE(kept_inside(e), kept_inside(other));
}

TEST(EvalLaterQuestion, TurnsAppendEachAnswerAndAskTheNext) {
  std::mt19937_64 rng(30);
  Episode e = maker().multikey(600, 0.5, rng);
  // Each turn's answer = the full cache's own continuation after the previous turns, so every
  // verdict is true only if each turn is fed exactly: the document, the question, the whole
  // answer, then "\n" + the next question.
  std::vector<int> sequence = e.prompt;
  e.answer = full_continuation(sequence, 5);
  sequence.insert(sequence.end(), e.answer.begin(), e.answer.end());
  for (std::size_t t = 0; t < 2; ++t) {
    sequence.insert(sequence.end(), e.follow_ups[t].question.begin(), e.follow_ups[t].question.end());
    e.follow_ups[t].answer = full_continuation(sequence, 4);
    sequence.insert(sequence.end(), e.follow_ups[t].answer.begin(), e.follow_ups[t].answer.end());
  }
  CachedModel r(method("full"), e.length_with_turns(3));
  const LaterAnswers got = answer_later(r.transformer, e, 3);
  ASSERT_EQ(got.correct.size(), 3u);
  for (std::size_t t = 0; t < 3; ++t) EXPECT_TRUE(got.correct[t]) << "turn " << t + 1;
  EXPECT_EQ(r.transformer.next_position(), static_cast<std::int64_t>(sequence.size()) - 1);  // the last answer token is not fed
  EXPECT_THROW(answer_later(r.transformer, e, 5), std::invalid_argument);
  EXPECT_THROW(answer_later(r.transformer, e, 0), std::invalid_argument);
  EXPECT_THROW(answer_later(r.transformer, maker().passkey(400, 0.5, rng), 2), std::invalid_argument);
}

TEST(EvalLaterQuestion, ScoreKeysAndOptions) {
  EvalOptions o = EvalOptions::for_preset("quick");
  EXPECT_EQ(o.tasks, (std::vector<std::string>{"passkey", "kvlist", "multikey"}));
  EXPECT_EQ(o.score_keys(), (std::vector<std::string>{"passkey", "passkey@later", "kvlist", "kvlist@later", "multikey",
                                                      "multikey@later"}));
  o.turns = 3;
  o.settings = {"later"};
  EXPECT_EQ(o.score_keys(), (std::vector<std::string>{"passkey@later", "kvlist@later", "kvlist@turn2", "kvlist@turn3",
                                                      "multikey@later", "multikey@turn2", "multikey@turn3"}));
  const ScoreKey k = parse_score_key("kvlist@turn3");
  EXPECT_EQ(k.task, "kvlist");
  EXPECT_EQ(k.setting, "later");
  EXPECT_EQ(k.turn, 3u);
  EXPECT_EQ(parse_score_key("passkey").setting, "inside");
  EXPECT_THROW(parse_score_key("kvlist@soon"), std::invalid_argument);
  o.validate();
  o.settings = {"sometime"};
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o.settings = {"inside"};
  o.turns = 5;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o.turns = 1;
  o.tasks = {"vault"};
  EXPECT_THROW(o.validate(), std::invalid_argument);
}

// A run with both settings and three turns: every figure reported, later turns included, and the
// full cache scores its own figures identically in both settings.
TEST(EvalLaterQuestion, RunEvalReportsBothSettingsAndEveryTurn) {
  static const EpisodeMaker m = maker();
  EvalInputs in;
  in.model_dir = "random";
  in.text_source = "synthetic";
  for (int i = 0; i < 300; ++i) in.text_tokens.push_back((i * 31 + 7) % 250);
  in.bos = kBos;
  in.episodes = &m;
  EvalOptions o = EvalOptions::for_preset("quick");
  o.methods = "h2o";
  o.levels = {0.5};
  o.text_contexts = {48};
  o.continuation = 4;
  o.windows = 1;
  o.tasks = {"kvlist", "multikey"};
  o.turns = 3;
  o.retrieval_lengths = {420};
  o.depths = {0.5};
  o.trials = 2;
  o.speed = false;
  o.threads = 2;
  o.progress = false;
  o.min_full_accuracy = 0.0;
  const EvalResults r = run_eval(testing::small_model(), in, o);
  ASSERT_EQ(r.points.size(), 1u);
  ASSERT_TRUE(r.points[0].error.empty()) << r.points[0].error;
  ASSERT_EQ(r.points[0].retrieval.size(), 8u);  // 2 tasks x (inside, later, turn 2, turn 3)
  for (const auto& s : r.points[0].retrieval) EXPECT_EQ(s.total(), 2u) << s.task;
  // Past the model's context with the follow-ups: refused before any model work.
  o.retrieval_lengths = {4090};  // the model's max_position_embeddings is 4096
  EXPECT_THROW(run_eval(testing::small_model(), in, o), std::invalid_argument);
}

}  // namespace
}  // namespace kvslim::engine::eval
