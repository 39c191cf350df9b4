#include "engine/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "engine/utf8.h"
#include "kvslim/errors.h"

namespace kvslim::engine {
namespace {

using json_util::Json;
using json_util::Where;

// The regex HF's ByteLevel pre-tokenizer uses when use_regex is true (GPT-2).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Bounds on PCRE2 backtracking so that a hostile pattern fails instead of hanging.
constexpr uint32_t kMatchLimit = 10'000'000;
// JIT backtracking stack: long runs (e.g. a megabyte of spaces against \s+(?!\S)) need more
// than PCRE2's 32 KiB default. One lazily grown stack per thread.
constexpr std::size_t kJitStackStart = 32 * 1024;
constexpr std::size_t kJitStackMax = 64 * 1024 * 1024;

pcre2_jit_stack* thread_jit_stack(void*) {
  struct Holder {
    pcre2_jit_stack* stack = nullptr;
    ~Holder() {
      if (stack) pcre2_jit_stack_free(stack);
    }
  };
  thread_local Holder holder;
  if (holder.stack == nullptr) holder.stack = pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr);
  return holder.stack;  // nullptr falls back to PCRE2's small machine-stack area
}

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

using Span = std::pair<std::size_t, std::size_t>;  // [begin, end) in bytes
struct Part {
  Span span;
  bool is_match;
};

// HF's find_matches: matches and the gaps between them, in order.
std::vector<Part> matches_and_gaps(const Regex& regex, std::string_view text) {
  std::vector<Part> parts;
  parts.reserve(text.size() / 2 + 2);
  std::size_t prev = 0;
  for (const auto& [begin, end] : regex.find_all(text)) {
    if (prev != begin) parts.push_back({{prev, begin}, false});
    parts.push_back({{begin, end}, true});
    prev = end;
  }
  if (prev != text.size()) parts.push_back({{prev, text.size()}, false});
  return parts;
}

// HF's SplitDelimiterBehavior applied to the (match, gap) list.
std::vector<Part> apply_behavior(std::vector<Part> parts, SplitBehavior behavior) {
  std::vector<Part> out;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      return parts;
    case SplitBehavior::removed:
      for (const Part& p : parts) {
        if (!p.is_match) out.push_back(p);
      }
      return out;
    case SplitBehavior::merged_with_previous:
      for (const Part& p : parts) {
        if (p.is_match && !previous_match) {
          if (!out.empty()) out.back().span.second = p.span.second;
          else out.push_back({p.span, true});
        } else {
          out.push_back(p);
        }
        previous_match = p.is_match;
      }
      return out;
    case SplitBehavior::merged_with_next:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match) {
          if (!out.empty()) out.back().span.first = it->span.first;
          else out.push_back({it->span, true});
        } else {
          out.push_back(*it);
        }
        previous_match = it->is_match;
      }
      return {out.rbegin(), out.rend()};
    case SplitBehavior::contiguous:
      for (const Part& p : parts) {
        if (p.is_match == previous_match) {
          if (!out.empty()) out.back().span.second = p.span.second;
          else out.push_back({p.span, false});
        } else {
          out.push_back(p);
        }
        previous_match = p.is_match;
      }
      return out;
  }
  return parts;
}

SplitBehavior parse_behavior(const std::string& name, const Where& where) {
  if (name == "Removed") return SplitBehavior::removed;
  if (name == "Isolated") return SplitBehavior::isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (name == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (name == "Contiguous") return SplitBehavior::contiguous;
  json_util::fail(where, "unknown split behavior '" + name + "'");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Regex

struct Regex::Code {
  pcre2_code* code = nullptr;
  pcre2_match_context* context = nullptr;
  ~Code() {
    if (context) pcre2_match_context_free(context);
    if (code) pcre2_code_free(code);
  }
};

Regex::Regex(std::string_view pattern, bool literal, const Where& where) {
  auto code = std::make_shared<Code>();
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2_LITERAL admits UTF but not UCP (which only matters for character classes anyway).
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                             &error_offset, nullptr);
  if (code->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    json_util::fail(where, "regex does not compile at offset " + std::to_string(error_offset) + ": " +
                               reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code->context = pcre2_match_context_create(nullptr);
  if (code->context == nullptr) throw std::bad_alloc();
  pcre2_set_match_limit(code->context, kMatchLimit);
  pcre2_jit_stack_assign(code->context, thread_jit_stack, nullptr);
  code_ = std::move(code);
}

std::vector<std::pair<std::size_t, std::size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  out.reserve(text.size() / 4 + 1);
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  if (match == nullptr) throw std::bad_alloc();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t start = 0;
  while (start <= text.size()) {
    // The caller guarantees valid UTF-8, and `start` always sits on a character boundary.
    const int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, match, code_->context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(match);
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw kvslim::InputError(std::string("tokenizer pre-split regex failed: ") + reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const std::size_t begin = ovector[0], end = ovector[1];
    if (end < begin) break;  // \K games in a lookaround; stop rather than loop
    out.emplace_back(begin, end);
    if (end > start) {
      start = end;
    } else {  // empty match: step over one character
      if (start == text.size()) break;
      start += utf8::sequence_length(static_cast<unsigned char>(text[start]));
    }
  }
  pcre2_match_data_free(match);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Byte-level table

const ByteLevelTable& ByteLevelTable::get() {
  static const ByteLevelTable table = [] {
    ByteLevelTable t;
    t.char_to_byte.fill(-1);
    // Printable Latin-1 bytes stand for themselves; the rest map to 256, 257, ... in byte order.
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const int cp = printable(b) ? b : next++;
      std::string s;
      utf8::append(s, static_cast<char32_t>(cp));
      t.byte_to_char[b] = s;
      t.char_to_byte[cp] = b;
    }
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer steps

struct PreTokenizer::Step {
  enum class Kind { split, byte_level } kind;
  // split
  std::shared_ptr<const Regex> regex;  // null for an empty literal (matches nothing)
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  // byte_level
  bool add_prefix_space = false;
  bool use_regex = false;

  // Splits one piece; calls next(sub_piece) for each output piece, in order.
  template <class Next>
  void run(std::string_view piece, Next&& next) const {
    if (kind == Kind::split) {
      std::vector<Part> parts;
      if (regex) parts = matches_and_gaps(*regex, piece);
      else if (!piece.empty()) parts.push_back({{0, piece.size()}, false});
      if (invert) {
        for (Part& p : parts) p.is_match = !p.is_match;
      }
      if (behavior != SplitBehavior::isolated) parts = apply_behavior(std::move(parts), behavior);
      for (const Part& p : parts) {
        if (p.span.second > p.span.first) next(piece.substr(p.span.first, p.span.second - p.span.first));
      }
      return;
    }
    // ByteLevel: optional prefix space, optional GPT-2 split, then the byte -> char mapping.
    std::string prefixed;
    if (add_prefix_space && (piece.empty() || piece.front() != ' ')) {
      prefixed.reserve(piece.size() + 1);
      prefixed = " ";
      prefixed += piece;
      piece = prefixed;
    }
    const ByteLevelTable& table = ByteLevelTable::get();
    std::string mapped;  // reused for every sub-piece; `next` is done with it before the next one
    auto emit = [&](std::string_view sub) {
      if (sub.empty()) return;
      mapped.clear();
      for (unsigned char b : sub) mapped += table.byte_to_char[b];
      next(std::string_view(mapped));
    };
    if (use_regex) {
      static const Regex gpt2(kGpt2Pattern, false, Where{"(built-in)", "GPT-2 regex"});
      for (const Part& p : matches_and_gaps(gpt2, piece)) emit(piece.substr(p.span.first, p.span.second - p.span.first));
    } else {
      emit(piece);
    }
  }
};

void PreTokenizer::add_steps(const Json& spec, const Where& where, std::vector<std::shared_ptr<const Step>>& steps, int depth) {
  if (spec.is_null()) return;
  json_util::check_sequence_depth(depth, where);
  json_util::as_object(spec, where);
  const std::string type = json_util::as_string(json_util::require(spec, "type", where), where.field("type"));
  if (type == "Sequence") {
    const Where list_where = where.field("pretokenizers");
    const Json& list = json_util::as_array(json_util::require(spec, "pretokenizers", where), list_where);
    for (std::size_t i = 0; i < list.size(); ++i) add_steps(list[i], list_where.index(i), steps, depth + 1);
    return;
  }
  auto step = std::make_shared<Step>();
  if (type == "Split") {
    step->kind = Step::Kind::split;
    const Where pattern_where = where.field("pattern");
    const Json& pattern = json_util::as_object(json_util::require(spec, "pattern", where), pattern_where);
    if (const Json* re = json_util::find(pattern, "Regex", pattern_where)) {
      step->regex = std::make_shared<Regex>(json_util::as_string(*re, pattern_where.field("Regex")), false,
                                            pattern_where.field("Regex"));
    } else if (const Json* lit = json_util::find(pattern, "String", pattern_where)) {
      const std::string literal = json_util::as_string(*lit, pattern_where.field("String"));
      if (!literal.empty()) step->regex = std::make_shared<Regex>(literal, true, pattern_where.field("String"));
    } else {
      json_util::fail(pattern_where, "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    step->behavior = parse_behavior(json_util::as_string(json_util::require(spec, "behavior", where), where.field("behavior")),
                                    where.field("behavior"));
    step->invert = json_util::get_bool(spec, "invert", where, false);
  } else if (type == "ByteLevel") {
    step->kind = Step::Kind::byte_level;
    step->add_prefix_space = json_util::get_bool(spec, "add_prefix_space", where, true);
    step->use_regex = json_util::get_bool(spec, "use_regex", where, true);
  } else {
    json_util::fail(where.field("type"), "unsupported pre_tokenizer '" + type + "' (supported: Split, ByteLevel, Sequence)");
  }
  steps.push_back(std::move(step));
}

PreTokenizer PreTokenizer::from_json(const Json& spec, const Where& where) {
  PreTokenizer p;
  add_steps(spec, where, p.steps_);
  return p;
}

void PreTokenizer::run_from(std::size_t step, std::string_view piece, WordSink sink) const {
  if (step == steps_.size()) {
    if (!piece.empty()) sink(piece);
    return;
  }
  steps_[step]->run(piece, [&](std::string_view sub) { run_from(step + 1, sub, sink); });
}

void PreTokenizer::split(std::string_view text, WordSink sink) const { run_from(0, text, sink); }

void PreTokenizer::split(std::string_view text, std::vector<std::string>& words) const {
  auto collect = [&](std::string_view w) { words.emplace_back(w); };
  split(text, WordSink(collect));
}

}  // namespace kvslim::engine
