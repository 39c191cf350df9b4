// Retrieval episodes (passkey, key-value list) over a length x depth grid, built from the same
// template strings the shipped model was trained on (training/episodes.py, training/README.md),
// tokenized from their text as the HF evaluation does, and scored by exact match of the greedy
// answer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model.h"

namespace kvslim::engine::eval {

// Text -> token ids without special tokens (the model's tokenizer, or a test's byte encoder).
using EncodeFn = std::function<std::vector<int>(std::string_view)>;

// A question asked after the first answer, as the next turn of a chat about the same document
// (the format models/tiny was trained on: `\n{question} {answer}` lines after the first answer).
struct FollowUp {
  std::vector<int> question;    // encode("\n" + question)
  std::vector<int> answer;      // encode(" " + answer_text)
  std::string answer_text;
};

struct Episode {
  std::string task;             // "passkey", "kvlist" or "multikey"
  std::string text;             // prompt text (without BOS), ending with the question
  std::vector<int> prompt;      // [bos] + encode(text)
  // Index in `prompt` of the question's first token: prompt[0, question_start) is the document
  // (context), prompt[question_start, end) the question. The split is at a token boundary that
  // tokenizing the two halves alone reproduces (checked), so "question inside the prompt" and
  // "question after the compressed context" feed the model exactly the same tokens.
  std::size_t question_start = 0;
  // Further questions about other facts of the same document (kvlist: other pairs spread over
  // the list; multikey: the other needles); passkey has none.
  std::vector<FollowUp> follow_ups;
  std::vector<int> answer;      // encode(" " + answer_text): what greedy decoding must produce
  std::string answer_text;      // "48213"
  std::size_t length_requested = 0;  // target prompt + answer tokens
  double depth_requested = 0;
  double depth = 0;             // where the needle really starts, as a fraction of the body tokens
  std::size_t needle_token = 0; // index in `prompt` of the needle's first token
  std::size_t length() const { return prompt.size() + answer.size(); }
  // Tokens a run of `turns` questions feeds the model (prompt, answers, follow-up questions).
  std::size_t length_with_turns(std::size_t turns) const;
};

// The template strings (training/episodes.py; the README copies them verbatim).
struct EpisodeTemplates {
  static constexpr std::string_view kPasskeyHeader =
      "There is an important piece of information hidden inside a lot of irrelevant text. "
      "Find it and memorize it. I will quiz you about it.\n";
  static constexpr std::string_view kPasskeyNeedle = "The pass key is {key}. Remember it. {key} is the pass key.\n";
  static constexpr std::string_view kPasskeyQuestion = "What is the pass key? The pass key is";
  static constexpr std::string_view kKvHeader = "Below is a list of keys and their values. Remember them.\n";
  static constexpr std::string_view kKvLine = "{key}: {value}\n";
  static constexpr std::string_view kKvQuestion = "What is the value of key {key}? The value of key {key} is";
  static constexpr std::string_view kMultiHeader = "Several codes are hidden in the following text. Remember all of them.\n";
  static constexpr std::string_view kMultiNeedle = "The code for the {color} {thing} is {key}.\n";
  static constexpr std::string_view kMultiQuestion = "What is the code for the {color} {thing}? The code for the {color} {thing} is";
  static constexpr std::string_view kMultiColors[] = {"red",   "blue",  "green",  "yellow", "black",
                                                       "white", "orange", "purple", "silver", "golden"};
  static constexpr std::string_view kMultiThings[] = {"door", "box", "safe", "gate", "chest", "locker", "drawer", "room"};
  // The evaluation's multikey (training/train_tiny.py's probe and eval): 4 needles, 5-digit codes.
  static constexpr std::size_t kMultiNeedles = 4;
};

class EpisodeMaker {
 public:
  // `filler_lines`: lines of held-out prose (each gets a trailing "\n"; empty lines are dropped).
  // Throws std::invalid_argument when there is no filler text.
  EpisodeMaker(EncodeFn encode, std::optional<int> bos, std::vector<std::string> filler_lines);

  // A 5-digit pass key in held-out prose, its needle line inserted at the line boundary nearest
  // `depth` (0 = first, 1 = last) of the filler tokens; `length` = prompt + answer tokens (the
  // body is filled to it, so the real length is within a few tokens of it).
  Episode passkey(std::size_t length, double depth, std::mt19937_64& rng) const;
  // "key: value" lines (6-character keys, 5-digit values) up to `length`; the queried pair is the
  // one at `depth` of the list.
  Episode kvlist(std::size_t length, double depth, std::mt19937_64& rng) const;
  // kMultiNeedles "The code for the {color} {thing} is {key}." needles (distinct color/thing pairs
  // and 5-digit codes) in held-out prose; the queried one at `depth`, the others at random depths.
  Episode multikey(std::size_t length, double depth, std::mt19937_64& rng) const;
  // One of the above by name; throws std::invalid_argument for another task.
  Episode make(const std::string& task, std::size_t length, double depth, std::mt19937_64& rng) const;

 private:
  std::vector<int> encode(std::string_view text) const { return encode_(text); }
  Episode finish(std::string task, const std::string& body_before, const std::string& needle, const std::string& body_after,
                 const std::string& header, std::string_view question, const std::string& answer, std::size_t length,
                 double depth) const;
  // Consecutive prose lines from a random start, the last one cut at a word, `budget` tokens at
  // most; `tokens` gets each piece's token count.
  std::vector<std::string> filler(std::size_t budget, std::mt19937_64& rng, std::vector<std::size_t>& tokens) const;
  FollowUp follow_up(const std::string& question, const std::string& answer) const;

  EncodeFn encode_;
  std::optional<int> bos_;
  std::vector<std::string> lines_;        // each ends with "\n"
  std::vector<std::size_t> line_tokens_;  // tokens of each line encoded alone
};

// Fills every "{name}" in `pattern` with `value`.
std::string fill_template(std::string_view pattern, std::string_view name, std::string_view value);

// Exact match: the generated ids are the answer's ids, no more, no less.
bool answer_matches(std::span<const int> generated, std::span<const int> answer);

// Greedy decoding of answer.size() tokens after the prompt (stops at the first wrong token, which
// already decides the exact match). Resets the transformer first. Returns the generated ids.
std::vector<int> greedy_answer(Transformer& transformer, const Episode& episode);

// The question after the compressed context, as a chat turn would be: the document
// (prompt[0, question_start)) is prefilled in one call, so a compressing cache has chosen what to
// keep before any question token exists; the question follows in a later call, then greedy
// decoding. With turns > 1 the model's own answer is appended (as a chat appends it) and each
// follow-up question is asked in its own call after it. Resets the transformer first.
// `after_document`, when set, runs right after the document's call (tests read the caches there).
// Throws std::invalid_argument when the episode has fewer than turns - 1 follow-ups or turns is 0.
struct LaterAnswers {
  std::vector<std::vector<int>> generated;  // per turn (the last turn stops at its first wrong token)
  std::vector<bool> correct;                // per turn, exact match
};
LaterAnswers answer_later(Transformer& transformer, const Episode& episode, std::size_t turns,
                          const std::function<void()>& after_document = {});

}  // namespace kvslim::engine::eval
