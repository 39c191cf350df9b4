// Pre-tokenization for byte-level BPE as HF tokenizers does it: Split (regex or literal, with the
// five split behaviours), ByteLevel (optional GPT-2 regex and prefix space, then the GPT-2
// bytes_to_unicode mapping) and Sequence of those. Regexes run on PCRE2 (UTF + UCP, JIT).
#pragma once
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/json_util.h"

namespace kvslim::engine {

// A compiled PCRE2 pattern (shared, immutable, usable from several threads).
class Regex {
 public:
  // Throws ModelFileError naming `where` when the pattern does not compile.
  Regex(std::string_view pattern, bool literal, const json_util::Where& where);
  // Byte ranges [begin, end) of the successive matches in `text` (valid UTF-8), including empty
  // ones. Throws kvslim::InputError if the match exceeds PCRE2's backtracking limits.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view text) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

// GPT-2's bytes_to_unicode: every byte maps to one printable code point (as UTF-8).
struct ByteLevelTable {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the code point standing for each byte
  // Code point -> byte, for code points below 324 (the table's range); -1 when unmapped.
  std::array<int, 324> char_to_byte;
  static const ByteLevelTable& get();
};

// The pre-tokenizer pipeline of a tokenizer.json.
class PreTokenizer {
 public:
  PreTokenizer() = default;  // null pre-tokenizer: the text is one word
  static PreTokenizer from_json(const nlohmann::json& spec, const json_util::Where& where);
  // A non-owning callable taking one word; the view is valid only during the call.
  class WordSink {
   public:
    template <class F>
    WordSink(F& f) : object_(&f), call_([](void* o, std::string_view w) { (*static_cast<F*>(o))(w); }) {}
    void operator()(std::string_view word) const { call_(object_, word); }

   private:
    void* object_;
    void (*call_)(void*, std::string_view);
  };

  // Splits `text` (valid UTF-8) into words and hands each to `sink`, in order, depth first (no
  // list of all words is built).
  void split(std::string_view text, WordSink sink) const;
  // Convenience: appends the words to `words`.
  void split(std::string_view text, std::vector<std::string>& words) const;

 private:
  struct Step;
  void run_from(std::size_t step, std::string_view piece, WordSink sink) const;
  std::vector<std::shared_ptr<const Step>> steps_;
  static void add_steps(const nlohmann::json& spec, const json_util::Where& where, std::vector<std::shared_ptr<const Step>>& steps,
                        int depth = 0);
};

}  // namespace kvslim::engine
