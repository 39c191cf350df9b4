#include "engine/eval/retrieval.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "engine/sampler.h"

namespace kvslim::engine::eval {
namespace {

std::string random_number(std::mt19937_64& rng, int digits) {
  std::uniform_int_distribution<int> first(1, 9), rest(0, 9);
  std::string s(1, static_cast<char>('0' + first(rng)));
  for (int i = 1; i < digits; ++i) s += static_cast<char>('0' + rest(rng));
  return s;
}

std::string random_kv_key(std::mt19937_64& rng) {
  static constexpr std::string_view kFirst = "abcdefghijklmnopqrstuvwxyz";
  static constexpr std::string_view kRest = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::uniform_int_distribution<std::size_t> f(0, kFirst.size() - 1), r(0, kRest.size() - 1);
  std::string key(1, kFirst[f(rng)]);
  for (int i = 1; i < 6; ++i) key += kRest[r(rng)];
  return key;
}

void check_request(std::size_t length, double depth) {
  if (!(depth >= 0.0 && depth <= 1.0)) {
    throw std::invalid_argument("retrieval episode: depth " + std::to_string(depth) + " must be in [0, 1]");
  }
  if (length == 0) throw std::invalid_argument("retrieval episode: length must be >= 1");
}

}  // namespace

std::string fill_template(std::string_view pattern, std::string_view name, std::string_view value) {
  std::string tag(1, '{');
  tag.append(name);
  tag.push_back('}');
  std::string out;
  std::size_t at = 0;
  while (true) {
    const std::size_t hit = pattern.find(tag, at);
    out.append(pattern.substr(at, hit == std::string_view::npos ? std::string_view::npos : hit - at));
    if (hit == std::string_view::npos) break;
    out.append(value);
    at = hit + tag.size();
  }
  return out;
}

EpisodeMaker::EpisodeMaker(EncodeFn encode, std::optional<int> bos, std::vector<std::string> filler_lines)
    : encode_(std::move(encode)), bos_(bos) {
  for (auto& line : filler_lines) {
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    line += '\n';
    line_tokens_.push_back(encode_(line).size());
    lines_.push_back(std::move(line));
  }
  if (lines_.empty()) throw std::invalid_argument("retrieval episodes: the filler text has no non-empty line");
}

Episode EpisodeMaker::finish(std::string task, const std::string& body_before, const std::string& needle,
                             const std::string& body_after, const std::string& header, std::string_view question,
                             const std::string& answer, std::size_t length, double depth) const {
  Episode e;
  e.task = std::move(task);
  e.answer_text = answer;
  e.length_requested = length;
  e.depth_requested = depth;
  e.text = header + body_before + needle + body_after + std::string(question);
  const std::size_t lead = bos_ ? 1 : 0;
  if (bos_) e.prompt.push_back(*bos_);
  const std::vector<int> body = encode(e.text);
  e.prompt.insert(e.prompt.end(), body.begin(), body.end());
  e.answer = encode(" " + answer);
  // The answer must tokenize the same alone as after the question, or greedy decoding could be
  // right and still "miss" (the HF evaluation asserts the same).
  const std::vector<int> whole = encode(e.text + " " + answer);
  if (whole.size() != body.size() + e.answer.size() ||
      !std::equal(e.answer.begin(), e.answer.end(), whole.end() - static_cast<std::ptrdiff_t>(e.answer.size()))) {
    throw std::logic_error("retrieval episode: the answer \" " + answer +
                           "\" does not tokenize the same after the question (tokenizer merges across the boundary)");
  }
  const std::size_t body_start = lead + encode(header).size();
  e.needle_token = lead + encode(header + body_before).size();
  const std::vector<int> question_ids = encode(question);
  const std::size_t body_end = e.prompt.size() - question_ids.size();
  // The document and the question must tokenize alone as they do together, or the question-later
  // setting would feed other tokens than the question-inside one (the body ends in "\n", which the
  // pre-tokenizer splits from the question's first word).
  const std::vector<int> document = encode(header + body_before + needle + body_after);
  if (document.size() != body_end - lead || !std::equal(document.begin(), document.end(), e.prompt.begin() + static_cast<std::ptrdiff_t>(lead)) ||
      !std::equal(question_ids.begin(), question_ids.end(), e.prompt.begin() + static_cast<std::ptrdiff_t>(body_end))) {
    throw std::logic_error("retrieval episode: the document and the question do not tokenize the same apart as together");
  }
  e.question_start = body_end;
  const std::size_t needle_tokens = encode(needle).size();
  const std::size_t filler = body_end > body_start + needle_tokens ? body_end - body_start - needle_tokens : 1;
  e.depth = static_cast<double>(e.needle_token - body_start) / static_cast<double>(filler);
  return e;
}

std::vector<std::string> EpisodeMaker::filler(std::size_t budget, std::mt19937_64& rng, std::vector<std::size_t>& piece_tokens) const {
  // Consecutive prose lines from a random start; the last one cut at a word so the total fits.
  std::vector<std::string> pieces;
  piece_tokens.clear();
  std::size_t total = 0;
  std::size_t i = std::uniform_int_distribution<std::size_t>(0, lines_.size() - 1)(rng);
  for (std::size_t guard = 0; total < budget && guard < lines_.size() * 4 + 16; ++guard, i = (i + 1) % lines_.size()) {
    const std::size_t room = budget - total;
    if (line_tokens_[i] <= room) {
      pieces.push_back(lines_[i]);
      piece_tokens.push_back(line_tokens_[i]);
      total += line_tokens_[i];
      continue;
    }
    std::string cut, best;
    std::size_t best_tokens = 0, start = 0;
    const std::string& line = lines_[i];
    while (start < line.size() - 1) {
      std::size_t end = line.find(' ', start + 1);
      if (end == std::string::npos || end > line.size() - 1) end = line.size() - 1;
      const std::string candidate = line.substr(0, end) + "\n";
      const std::size_t n = encode(candidate).size();
      if (n > room) break;
      best = candidate;
      best_tokens = n;
      start = end;
    }
    if (best_tokens > 0) {
      pieces.push_back(best);
      piece_tokens.push_back(best_tokens);
      total += best_tokens;
    }
    break;
  }
  return pieces;
}

Episode EpisodeMaker::passkey(std::size_t length, double depth, std::mt19937_64& rng) const {
  check_request(length, depth);
  const std::string key = random_number(rng, 5);
  const std::string header(EpisodeTemplates::kPasskeyHeader);
  const std::string needle = fill_template(EpisodeTemplates::kPasskeyNeedle, "key", key);
  const std::size_t fixed = (bos_ ? 1 : 0) + encode(header).size() + encode(needle).size() +
                            encode(EpisodeTemplates::kPasskeyQuestion).size() + encode(" " + key).size();
  if (length < fixed + 8) {
    throw std::invalid_argument("passkey episode: length " + std::to_string(length) + " leaves no room for filler (the template alone takes " +
                                std::to_string(fixed) + " tokens)");
  }
  const std::size_t budget = length - fixed;

  std::vector<std::size_t> piece_tokens;
  const std::vector<std::string> pieces = filler(budget, rng, piece_tokens);
  std::size_t total = 0;
  for (std::size_t n : piece_tokens) total += n;
  // The line boundary nearest depth * filler tokens.
  const double target = depth * static_cast<double>(total);
  std::size_t at = 0, acc = 0;
  double best_gap = target;
  for (std::size_t p = 0; p < pieces.size(); ++p) {
    acc += piece_tokens[p];
    if (std::abs(static_cast<double>(acc) - target) < best_gap) {
      best_gap = std::abs(static_cast<double>(acc) - target);
      at = p + 1;
    }
  }
  std::string before, after;
  for (std::size_t p = 0; p < pieces.size(); ++p) (p < at ? before : after) += pieces[p];
  return finish("passkey", before, needle, after, header, EpisodeTemplates::kPasskeyQuestion, key, length, depth);
}

Episode EpisodeMaker::kvlist(std::size_t length, double depth, std::mt19937_64& rng) const {
  check_request(length, depth);
  const std::string header(EpisodeTemplates::kKvHeader);
  std::vector<std::string> keys, values, lines;
  std::set<std::string> seen;
  // Reserve the question (its key is one of the list's: measure with a key of the same form).
  const std::size_t question_tokens =
      encode(fill_template(EpisodeTemplates::kKvQuestion, "key", random_kv_key(rng))).size() + 4;
  const std::size_t fixed = (bos_ ? 1 : 0) + encode(header).size() + question_tokens + 4;
  if (length < fixed + 16) {
    throw std::invalid_argument("kvlist episode: length " + std::to_string(length) + " leaves no room for pairs");
  }
  const std::size_t budget = length - fixed;
  std::size_t used = 0;
  while (true) {
    std::string key = random_kv_key(rng);
    if (!seen.insert(key).second) continue;
    const std::string value = random_number(rng, 5);
    std::string line = fill_template(fill_template(EpisodeTemplates::kKvLine, "key", key), "value", value);
    const std::size_t n = encode(line).size();
    if (used + n > budget && lines.size() >= 2) break;
    used += n;
    keys.push_back(std::move(key));
    values.push_back(value);
    lines.push_back(std::move(line));
  }
  const std::size_t q = std::min(lines.size() - 1, static_cast<std::size_t>(depth * static_cast<double>(lines.size())));
  std::string before, after;
  for (std::size_t p = 0; p < lines.size(); ++p) {
    if (p < q) before += lines[p];
    if (p > q) after += lines[p];
  }
  const std::string question = fill_template(EpisodeTemplates::kKvQuestion, "key", keys[q]);
  Episode e = finish("kvlist", before, lines[q], after, header, question, values[q], length, depth);
  // Follow-up questions: the pairs a quarter, a half and three quarters of the list away from the
  // first (wrapping), so later turns ask about every part of the list. No random draw: the
  // episodes of a seed stay those of earlier releases.
  const std::size_t n = lines.size();
  for (std::size_t k = 1; k < 4; ++k) {
    const std::size_t j = (q + k * n / 4) % n;
    if (j == q) continue;
    e.follow_ups.push_back(follow_up(fill_template(EpisodeTemplates::kKvQuestion, "key", keys[j]), values[j]));
  }
  return e;
}

Episode EpisodeMaker::multikey(std::size_t length, double depth, std::mt19937_64& rng) const {
  check_request(length, depth);
  const std::size_t n = EpisodeTemplates::kMultiNeedles;
  // Distinct (color, thing) pairs and distinct 5-digit codes, as training/episodes.py draws them.
  std::vector<std::pair<std::string_view, std::string_view>> all;
  for (auto c : EpisodeTemplates::kMultiColors) {
    for (auto t : EpisodeTemplates::kMultiThings) all.emplace_back(c, t);
  }
  std::vector<std::pair<std::string_view, std::string_view>> pairs;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t pick = std::uniform_int_distribution<std::size_t>(i, all.size() - 1)(rng);
    std::swap(all[i], all[pick]);
    pairs.push_back(all[i]);
  }
  std::vector<std::string> keys;
  while (keys.size() < n) {
    std::string k = random_number(rng, 5);
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(std::move(k));
  }
  const std::size_t q = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  auto fill = [](std::string_view pattern, std::pair<std::string_view, std::string_view> p) {
    return fill_template(fill_template(pattern, "color", p.first), "thing", p.second);
  };
  std::vector<std::string> needles;
  std::size_t needle_tokens = 0;
  for (std::size_t i = 0; i < n; ++i) {
    needles.push_back(fill_template(fill(EpisodeTemplates::kMultiNeedle, pairs[i]), "key", keys[i]));
    needle_tokens += encode(needles.back()).size();
  }
  const std::string header(EpisodeTemplates::kMultiHeader);
  const std::string question = fill(EpisodeTemplates::kMultiQuestion, pairs[q]);
  const std::size_t fixed = (bos_ ? 1 : 0) + encode(header).size() + needle_tokens + encode(question).size() +
                            encode(" " + keys[q]).size();
  if (length < fixed + 8) {
    throw std::invalid_argument("multikey episode: length " + std::to_string(length) +
                                " leaves no room for filler (the template and needles alone take " + std::to_string(fixed) +
                                " tokens)");
  }
  std::vector<std::size_t> piece_tokens;
  const std::vector<std::string> prose = filler(length - fixed, rng, piece_tokens);
  std::size_t total = 0;
  for (std::size_t t : piece_tokens) total += t;
  std::vector<double> depths(n);
  for (auto& d : depths) d = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  depths[q] = depth;
  // Each needle at the line boundary nearest its depth of the prose tokens; `slot[i]` = the number
  // of prose pieces before needle i (needles sharing a boundary keep their index order).
  std::vector<std::size_t> slot(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const double target = depths[i] * static_cast<double>(total);
    std::size_t acc = 0;
    double best_gap = target;
    for (std::size_t p = 0; p < prose.size(); ++p) {
      acc += piece_tokens[p];
      if (std::abs(static_cast<double>(acc) - target) < best_gap) {
        best_gap = std::abs(static_cast<double>(acc) - target);
        slot[i] = p + 1;
      }
    }
  }
  std::string before, after;
  bool queried_placed = false;
  for (std::size_t p = 0; p <= prose.size(); ++p) {
    for (std::size_t i = 0; i < n; ++i) {
      if (slot[i] != p) continue;
      if (i == q) {
        queried_placed = true;
      } else {
        (queried_placed ? after : before) += needles[i];
      }
    }
    if (p < prose.size()) (queried_placed ? after : before) += prose[p];
  }
  Episode e = finish("multikey", before, needles[q], after, header, question, keys[q], length, depth);
  for (std::size_t i = 0; i < n; ++i) {
    if (i != q) e.follow_ups.push_back(follow_up(fill(EpisodeTemplates::kMultiQuestion, pairs[i]), keys[i]));
  }
  return e;
}

Episode EpisodeMaker::make(const std::string& task, std::size_t length, double depth, std::mt19937_64& rng) const {
  if (task == "passkey") return passkey(length, depth, rng);
  if (task == "kvlist") return kvlist(length, depth, rng);
  if (task == "multikey") return multikey(length, depth, rng);
  throw std::invalid_argument("retrieval task \"" + task + "\": expected passkey, kvlist or multikey");
}

FollowUp EpisodeMaker::follow_up(const std::string& question, const std::string& answer) const {
  FollowUp f;
  f.question = encode("\n" + question);
  f.answer = encode(" " + answer);
  f.answer_text = answer;
  const std::vector<int> whole = encode("\n" + question + " " + answer);
  if (whole.size() != f.question.size() + f.answer.size() ||
      !std::equal(f.question.begin(), f.question.end(), whole.begin()) ||
      !std::equal(f.answer.begin(), f.answer.end(), whole.begin() + static_cast<std::ptrdiff_t>(f.question.size()))) {
    throw std::logic_error("retrieval follow-up: \"" + question + " " + answer + "\" does not tokenize the same in pieces");
  }
  return f;
}

std::size_t Episode::length_with_turns(std::size_t turns) const {
  std::size_t n = length();
  for (std::size_t t = 1; t < turns && t - 1 < follow_ups.size(); ++t) {
    n += follow_ups[t - 1].question.size() + follow_ups[t - 1].answer.size();
  }
  return n;
}

bool answer_matches(std::span<const int> generated, std::span<const int> answer) {
  return !answer.empty() && generated.size() == answer.size() && std::equal(answer.begin(), answer.end(), generated.begin());
}

std::vector<int> greedy_answer(Transformer& transformer, const Episode& episode) {
  if (episode.prompt.empty() || episode.answer.empty()) {
    throw std::invalid_argument("greedy_answer: the episode has no prompt or no answer");
  }
  transformer.reset();
  std::vector<int> out;
  std::span<const float> logits = transformer.prefill(episode.prompt);
  for (std::size_t i = 0; i < episode.answer.size(); ++i) {
    const int next = argmax(logits);
    out.push_back(next);
    if (next != episode.answer[i] || i + 1 == episode.answer.size()) break;
    logits = transformer.decode(next);
  }
  return out;
}

LaterAnswers answer_later(Transformer& transformer, const Episode& episode, std::size_t turns,
                          const std::function<void()>& after_document) {
  if (episode.prompt.empty() || episode.answer.empty() || episode.question_start == 0 ||
      episode.question_start >= episode.prompt.size()) {
    throw std::invalid_argument("answer_later: the episode has no document, no question or no answer");
  }
  if (turns == 0 || turns > episode.follow_ups.size() + 1) {
    throw std::invalid_argument("answer_later: " + std::to_string(turns) + " turns asked of a " + episode.task +
                                " episode that has " + std::to_string(episode.follow_ups.size() + 1) + " question(s)");
  }
  transformer.reset();
  const std::span<const int> prompt(episode.prompt);
  // The document alone: a compressing cache decides what it keeps here, before any question token.
  transformer.prefill(prompt.first(episode.question_start));
  if (after_document) after_document();
  std::span<const float> logits = transformer.prefill(prompt.subspan(episode.question_start));
  LaterAnswers result;
  std::vector<int> feed;
  for (std::size_t t = 0; t < turns; ++t) {
    const std::vector<int>& answer = t == 0 ? episode.answer : episode.follow_ups[t - 1].answer;
    const bool last = t + 1 == turns;
    std::vector<int> out;
    for (std::size_t i = 0; i < answer.size(); ++i) {
      const int next = argmax(logits);
      out.push_back(next);
      if (i + 1 == answer.size()) break;
      // The last turn stops at the first wrong token (it decides the match); earlier turns write
      // their whole answer, which the next turn reads as a chat would.
      if (last && next != answer[i]) break;
      logits = transformer.decode(next);
    }
    result.correct.push_back(answer_matches(out, answer));
    result.generated.push_back(out);
    if (last) break;
    // The answer's last token and the next question in one call (a chat's next user turn).
    feed.assign(1, out.back());
    const std::vector<int>& question = episode.follow_ups[t].question;
    feed.insert(feed.end(), question.begin(), question.end());
    logits = transformer.prefill(feed);
  }
  return result;
}

}  // namespace kvslim::engine::eval
