// libFuzzer target: a prompt file's bytes (what `generate --prompt-file` and `eval --text` read,
// issue 26) through a Llama-3-style tokenizer built here: NFC normalizer, regex Split + ByteLevel
// pre-tokenizer, byte-level BPE, added special tokens. Any bytes must encode, decode and stream
// back without a crash or a hang; the only exception allowed is kvslim::InputError from a regex
// that hits its match limit. Its corpus (fuzz/corpus/prompt) holds the prompt files of issue 26.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "engine/pretokenizer.h"
#include "engine/tokenizer.h"
#include "kvslim/errors.h"

namespace {

const kvslim::engine::Tokenizer& tokenizer() {
  static const kvslim::engine::Tokenizer tok = [] {
    using nlohmann::ordered_json;
    const auto& table = kvslim::engine::ByteLevelTable::get();
    ordered_json vocab = ordered_json::object();
    for (int b = 0; b < 256; ++b) vocab[table.byte_to_char[b]] = b;
    ordered_json merges = ordered_json::array();
    int id = 256;
    for (const char* m : {"Ġ t", "h e", "Ġt he", "i n", "e r"}) {
      const std::string s(m);
      const auto sp = s.find(' ');
      vocab[s.substr(0, sp) + s.substr(sp + 1)] = id++;
      merges.push_back(s);
    }
    auto special = [](int i, const char* content) {
      return ordered_json{{"id", i}, {"content", content}, {"single_word", false}, {"lstrip", false},
                          {"rstrip", false}, {"normalized", false}, {"special", true}};
    };
    const ordered_json doc = {
        {"added_tokens", {special(300, "<s>"), special(301, "</s>"), special(302, "<|endoftext|>")}},
        {"normalizer", {{"type", "NFC"}}},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
        {"post_processor", nullptr},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
    };
    return kvslim::engine::Tokenizer::from_json_text(doc.dump(), "prompt_fuzz tokenizer");
  }();
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvslim::engine;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Tokenizer& tok = tokenizer();
  try {
    const std::vector<int> ids = tok.encode(text, /*add_special_tokens=*/true);
    const std::string back = tok.decode(ids);
    StreamDecoder stream(tok, true);
    std::string streamed;
    for (int id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    (void)back;
    (void)streamed;
  } catch (const kvslim::InputError&) {
  }
  return 0;
}
