// Tests for the tokenizer.json BPE: a small hand-made byte-level tokenizer whose ids are worked out
// by hand (merge ranks, regex pre-split, added tokens, NFC, templates), decoding and streaming,
// every error path, and golden ids produced by HF tokenizers (tests/golden/tokenizers).
#include "engine/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <tuple>
#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/loader_test_util.h"
#include "engine/pretokenizer.h"
#include "kvslim/errors.h"

namespace kvslim::engine {
namespace {

using nlohmann::json;
using testing::expect_error;

constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json added_token(int id, const std::string& content, bool special, bool lstrip = false, bool rstrip = false,
                 bool single_word = false) {
  return {{"id", id}, {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", false}, {"special", special}};
}

// Byte-level vocab: the token for byte b is GPT-2's character for b, with id b. Then 8 merges
// (ids 256..263) and added tokens 300..305; ids 264..299 are holes.
json make_tokenizer_json(bool pair_merges = false) {
  const ByteLevelTable& table = ByteLevelTable::get();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[table.byte_to_char[b]] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"l", "l"}, {"e", "ll"}, {"h", "ell"}, {"hell", "o"}, {"3", "4"}};
  json merge_list = json::array();
  int next_id = 256;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = next_id++;
    merge_list.push_back(pair_merges ? json::array({a, b}) : json(a + " " + b));
  }
  json added = json::array({added_token(300, "<|bos|>", true), added_token(301, "<|eos|>", true),
                            added_token(302, "<mask>", true, /*lstrip=*/true, /*rstrip=*/true),
                            added_token(303, "<|x|>", true), added_token(304, "<|x|>yz", true),
                            added_token(305, "ab", false, false, false, /*single_word=*/true)});
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"post_processor",
       {{"type", "Sequence"},
        {"processors",
         {{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}},
          {{"type", "TemplateProcessing"},
           {"single", {{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
           {"pair", json::array()},
           {"special_tokens", {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {300}}, {"tokens", {"<|bos|>"}}}}}}}}}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merge_list}}},
  };
}

Tokenizer make_tokenizer(const json& j = make_tokenizer_json()) { return Tokenizer::from_json_text(j.dump()); }

using Ids = std::vector<int>;

TEST(ByteLevelTable, MatchesGpt2) {
  const ByteLevelTable& t = ByteLevelTable::get();
  EXPECT_EQ(t.byte_to_char[' '], "\u0120");   // Ġ
  EXPECT_EQ(t.byte_to_char['\n'], "\u010A");  // Ċ
  EXPECT_EQ(t.byte_to_char[0xAD], "\u0143");  // Ń, the last remapped byte
  EXPECT_EQ(t.byte_to_char['A'], "A");
  EXPECT_EQ(t.byte_to_char[0xE9], "\u00E9");
  EXPECT_EQ(t.char_to_byte[0x120], ' ');
  EXPECT_EQ(t.char_to_byte[0x143], 0xAD);
  EXPECT_EQ(t.char_to_byte[0x20], -1);  // a raw space is not a byte-level character
}

TEST(Tokenizer, MergesApplyByRank) {
  const Tokenizer tok = make_tokenizer();
  // h-e (rank 1) wins over l-l (rank 3), after which e-ll (rank 4) can no longer apply.
  EXPECT_EQ(tok.encode("hello", false), (Ids{257, 259, 'o'}));
  EXPECT_EQ(tok.encode("hell", false), (Ids{257, 259}));
  EXPECT_EQ(tok.encode("ell", false), (Ids{260}));
  EXPECT_EQ(tok.encode(" the", false), (Ids{258}));  // Ġ-t, h-e, then Ġt-he
  EXPECT_EQ(tok.encode("there", false), (Ids{'t', 257, 'r', 'e'}));
}

TEST(Tokenizer, PairMergesEqualStringMerges) {
  const Tokenizer a = make_tokenizer(make_tokenizer_json(false));
  const Tokenizer b = make_tokenizer(make_tokenizer_json(true));
  for (const char* s : {"hello there", " the hell 12345", "shell-shocked"}) EXPECT_EQ(a.encode(s), b.encode(s)) << s;
}

TEST(Tokenizer, IgnoreMerges) {
  json j = make_tokenizer_json();
  j["model"]["ignore_merges"] = true;
  const Tokenizer tok = make_tokenizer(j);
  EXPECT_EQ(tok.encode("hello", false), (Ids{262}));  // the whole word is a token
  EXPECT_EQ(tok.encode("hell", false), (Ids{261}));
  EXPECT_EQ(tok.encode("hellos", false), (Ids{257, 259, 'o', 's'}));
}

TEST(Tokenizer, RegexSplitBlocksMergesAcrossPieces) {
  const Tokenizer tok = make_tokenizer();
  EXPECT_EQ(tok.encode("345", false), (Ids{263, '5'}));
  // \p{N}{1,3} splits "12345" into "123" + "45", so the 3-4 merge cannot happen.
  EXPECT_EQ(tok.encode("12345", false), (Ids{'1', '2', '3', '4', '5'}));
  EXPECT_EQ(tok.encode("a\r\nb", false), (Ids{'a', '\r', '\n', 'b'}));
  EXPECT_EQ(tok.encode("\xF0\x9F\x98\x80", false), (Ids{0xF0, 0x9F, 0x98, 0x80}));  // 😀 as bytes
}

TEST(Tokenizer, SpecialTokensAndTemplate) {
  const Tokenizer tok = make_tokenizer();
  EXPECT_EQ(tok.bos_id(), 300);
  EXPECT_EQ(tok.encode("hello"), (Ids{300, 257, 259, 'o'}));
  EXPECT_EQ(tok.encode("hi<|eos|>there"), (Ids{300, 'h', 'i', 301, 't', 257, 'r', 'e'}));
  EXPECT_EQ(tok.encode("<|bos|>", false), (Ids{300}));
  EXPECT_EQ(tok.encode("", true), (Ids{300}));
  EXPECT_EQ(tok.encode("", false), (Ids{}));
  // No lstrip/rstrip: the spaces stay with the text.
  EXPECT_EQ(tok.encode("a <|eos|> b", false), (Ids{'a', ' ', 301, ' ', 'b'}));
  // lstrip + rstrip: the spaces around <mask> are absorbed into it.
  EXPECT_EQ(tok.encode("a <mask> b", false), (Ids{'a', 302, 'b'}));
  EXPECT_EQ(tok.encode("a  \t<mask>\n b", false), (Ids{'a', 302, 'b'}));
}

TEST(Tokenizer, AddedTokensLongestMatchAndSingleWord) {
  const Tokenizer tok = make_tokenizer();
  EXPECT_EQ(tok.encode("<|x|>yz!", false), (Ids{304, '!'}));
  EXPECT_EQ(tok.encode("<|x|>y", false), (Ids{303, 'y'}));
  EXPECT_EQ(tok.encode("ab cd", false), (Ids{305, ' ', 'c', 'd'}));
  EXPECT_EQ(tok.encode("xab", false), (Ids{'x', 'a', 'b'}));  // single_word: not inside a word
  EXPECT_EQ(tok.encode("abc", false), (Ids{'a', 'b', 'c'}));
}

TEST(Tokenizer, NfcNormalizer) {
  const std::string decomposed = "e\xCC\x81";  // e + U+0301 combining acute
  EXPECT_EQ(make_tokenizer().encode(decomposed, false), (Ids{'e', 0xCC, 0x81}));
  json j = make_tokenizer_json();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  const Tokenizer tok = make_tokenizer(j);
  EXPECT_EQ(tok.encode(decomposed, false), (Ids{0xC3, 0xA9}));  // U+00E9
  EXPECT_EQ(tok.decode(tok.encode(decomposed, false)), "\xC3\xA9");
  EXPECT_EQ(tok.encode(std::string("a\0b", 3), false), (Ids{'a', 0, 'b'}));  // NUL survives NFC
}

TEST(Tokenizer, Gpt2ByteLevelPreTokenizer) {
  json j = make_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}, {"trim_offsets", true}};
  EXPECT_EQ(make_tokenizer(j).encode("hello world", false), (Ids{' ', 257, 259, 'o', ' ', 'w', 'o', 'r', 'l', 'd'}));
  j["pre_tokenizer"]["add_prefix_space"] = false;
  EXPECT_EQ(make_tokenizer(j).encode("hello world", false), (Ids{257, 259, 'o', ' ', 'w', 'o', 'r', 'l', 'd'}));
}

TEST(Tokenizer, SplitBehaviours) {
  json j = make_tokenizer_json();
  auto with_split = [&](const std::string& behavior) {
    j["pre_tokenizer"]["pretokenizers"][0] = {
        {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", behavior}, {"invert", false}};
    return make_tokenizer(j).encode("the thello", false);
  };
  EXPECT_EQ(with_split("Removed"), (Ids{'t', 257, 't', 257, 259, 'o'}));
  EXPECT_EQ(with_split("Isolated"), (Ids{'t', 257, ' ', 't', 257, 259, 'o'}));
  EXPECT_EQ(with_split("Contiguous"), (Ids{'t', 257, ' ', 't', 257, 259, 'o'}));
  EXPECT_EQ(with_split("MergedWithPrevious"), (Ids{'t', 257, ' ', 't', 257, 259, 'o'}));
  EXPECT_EQ(with_split("MergedWithNext"), (Ids{'t', 257, 258, 259, 'o'}));  // " thello": Ġt-he merges
}

TEST(Tokenizer, DecodeAndSkipSpecial) {
  const Tokenizer tok = make_tokenizer();
  const Ids ids = tok.encode("hi<|eos|> the hello");
  EXPECT_EQ(tok.decode(ids), "<|bos|>hi<|eos|> the hello");
  EXPECT_EQ(tok.decode(ids, true), "hi the hello");
  EXPECT_EQ(tok.decode(Ids{280}), "");  // a hole in the id space decodes to nothing (as HF)
  EXPECT_THROW(tok.decode(Ids{306}), kvslim::InputError);
  EXPECT_THROW(tok.decode(Ids{-1}), kvslim::InputError);
  EXPECT_EQ(tok.decode(Ids{0xF0, 0x9F}), "\xEF\xBF\xBD");      // unfinished character -> U+FFFD
  EXPECT_EQ(tok.decode(Ids{0xFF, 'a'}), "\xEF\xBF\xBD" "a");  // invalid byte -> U+FFFD
  EXPECT_EQ(tok.vocab_size(), 306);
  EXPECT_EQ(tok.token_to_id("<|eos|>"), 301);
  EXPECT_EQ(tok.token_to_id("\u0120the"), 258);
  EXPECT_FALSE(tok.token_to_id("zzz").has_value());
  EXPECT_TRUE(tok.is_special(301));
  EXPECT_FALSE(tok.is_special(305));
}

const std::vector<std::string>& hard_strings() {
  static const std::vector<std::string> strings = {
      "Hello, world!",
      "  leading and trailing spaces   ",
      "tabs\tand\nnewlines\r\nand\r\rcarriage returns\n\n\n",
      "numbers 1 12 123 1234 12345 3.14159 -42 1,000,000",
      "contractions: I'm you're he'll she'd it's we've THEY'RE",
      "\xF0\x9F\x98\x80 emoji \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7 family",
      "\xE4\xB8\xAD\xE6\x96\x87\xE6\xB5\x8B\xE8\xAF\x95 CJK \xE3\x81\x93\xE3\x82\x93\xE3\x81\xAB\xE3\x81\xA1\xE3\x81\xAF",
      "caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 e\xCC\x81",
      "\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7",
      "<|bos|>special<|eos|> inside <mask> text<|x|>yz",
      "code: for (int i = 0; i < n; ++i) { x[i] *= 2; }",
      "   ",
      "",
      std::string("nul\0byte", 8),
  };
  return strings;
}

TEST(Tokenizer, RoundTripHardStrings) {
  const Tokenizer tok = make_tokenizer();
  for (const std::string& s : hard_strings()) {
    // <mask> strips the spaces around it, so compare against the text without them.
    std::string expected = s;
    if (auto p = expected.find(" <mask> "); p != std::string::npos) expected.replace(p, 8, "<mask>");
    EXPECT_EQ(tok.decode(tok.encode(s, false)), expected) << s;
  }
}

TEST(Tokenizer, InvalidUtf8InputThrows) {
  const Tokenizer tok = make_tokenizer();
  EXPECT_THROW(tok.encode("ab\xC3"), kvslim::InputError);
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), kvslim::InputError);  // a surrogate
}

TEST(StreamDecoder, HoldsSplitCharacters) {
  const Tokenizer tok = make_tokenizer();
  StreamDecoder stream(tok);
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push(0x98), "");
  EXPECT_EQ(stream.push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(stream.push(258), " the");
  EXPECT_EQ(stream.push(0xC3), "");
  EXPECT_EQ(stream.push('x'), "\xEF\xBF\xBDx");  // the lead byte turned out invalid
  EXPECT_EQ(stream.push(0xE4), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.flush(), "");
}

TEST(StreamDecoder, ConcatenationEqualsDecode) {
  const Tokenizer tok = make_tokenizer();
  for (const std::string& s : hard_strings()) {
    const Ids ids = tok.encode(s);
    StreamDecoder stream(tok, /*skip_special_tokens=*/true);
    std::string streamed;
    for (int id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    EXPECT_EQ(streamed, tok.decode(ids, true)) << s;
  }
}

TEST(Tokenizer, ByteFallbackAndUnk) {
  json j = {{"model",
             {{"type", "BPE"}, {"byte_fallback", true}, {"unk_token", "<unk>"}, {"fuse_unk", true},
              {"vocab", {{"a", 0}, {"<0xC3>", 1}, {"<0xA9>", 2}, {"<unk>", 3}}}, {"merges", json::array()}}}};
  const Tokenizer tok = Tokenizer::from_json_text(j.dump());
  EXPECT_EQ(tok.encode("a\xC3\xA9"), (Ids{0, 1, 2}));
  EXPECT_EQ(tok.encode("abba"), (Ids{0, 3, 0}));  // unknown 'b's fuse into one <unk>
  j["model"]["fuse_unk"] = false;
  EXPECT_EQ(Tokenizer::from_json_text(j.dump()).encode("abba"), (Ids{0, 3, 3, 0}));
  EXPECT_EQ(tok.decode(Ids{0, 3, 0}), "a <unk> a");  // no decoder: HF joins tokens with spaces
}

TEST(Tokenizer, Load) {
  testing::TempDir dir;
  testing::write_file(dir / "tokenizer.json", make_tokenizer_json().dump());
  EXPECT_EQ(Tokenizer::load(dir / "tokenizer.json").encode("hello", false), (Ids{257, 259, 'o'}));
  expect_error([&] { Tokenizer::load(dir / "missing.json"); }, {"missing.json", "cannot open"});
}

TEST(TokenizerErrors, NameTheField) {
  auto with = [](auto&& edit) {
    json j = make_tokenizer_json();
    edit(j);
    return j.dump();
  };
  expect_error([] { Tokenizer::from_json_text("{\"model\": ", "tok.json"); }, {"tok.json", "invalid JSON"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j.erase("model"); })); }, {"'model'", "missing"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["type"] = "WordPiece"; })); },
               {"model.type", "WordPiece"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["merges"][0] = "Ġ q"; })); },
               {"model.merges[0]", "'Ġq'"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["merges"][0] = "Ġ \u4e2d"; })); },
               {"model.merges[0]", "\u4e2d", "not in the vocab"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["merges"][0] = "abc"; })); },
               {"model.merges[0]", "one space"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["vocab"]["zz"] = 5; })); },
               {"model.vocab", "id 5"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["unk_token"] = "<unk>"; })); },
               {"model.unk_token", "<unk>"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["model"]["dropout"] = 0.1; })); }, {"model.dropout"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; })); },
               {"normalizer.type", "Lowercase"});
  expect_error([&] {
    Tokenizer::from_json_text(with([](json& j) {
      j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "NFKD"}}}}};
    }));
  }, {"normalizer.normalizers[1].type", "NFKD"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; })); },
               {"pre_tokenizer.type", "Whitespace"});
  expect_error([&] {
    Tokenizer::from_json_text(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; }));
  }, {"pre_tokenizer.pretokenizers[0].pattern.Regex", "does not compile"});
  expect_error([&] {
    Tokenizer::from_json_text(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }));
  }, {"behavior", "Sideways"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; })); },
               {"decoder.type", "WordPiece"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["post_processor"] = {{"type", "RobertaProcessing"}}; })); },
               {"post_processor.type", "RobertaProcessing"});
  expect_error([&] {
    Tokenizer::from_json_text(with([](json& j) { j["post_processor"]["processors"][1]["special_tokens"] = json::object(); }));
  }, {"special_tokens", "<|bos|>"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["truncation"] = {{"max_length", 8}}; })); }, {"truncation"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["added_tokens"][0]["content"] = ""; })); },
               {"added_tokens[0].content", "empty"});
  expect_error([&] { Tokenizer::from_json_text(with([](json& j) { j["added_tokens"][1]["id"] = 300; })); },
               {"added_tokens[1].id", "300"});
}

// ---------------------------------------------------------------------------------------------
// Golden ids from HF tokenizers (tests/golden/tokenizers, made on a GPU machine).

std::filesystem::path golden_dir() {
  if (const char* src = std::getenv("KVSLIM_SOURCE_DIR")) return std::filesystem::path(src) / "tests/golden/tokenizers";
  // Without ctest: look upwards from the working directory for the source tree.
  for (auto dir = std::filesystem::current_path(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / "tests/golden/tokenizers")) return dir / "tests/golden/tokenizers";
    if (dir == dir.parent_path()) break;
  }
  return "tests/golden/tokenizers";
}

// golden_ids.json: {"strings": [...], "tokenizers": {name: {"file", "vocab_size", "cases": [{"text",
// "ids" (with special tokens), "ids_no_special", "tokens_no_special", "decoded_no_special"}]}}}.
TEST(TokenizerGolden, MatchesHfTokenizers) {
  const std::filesystem::path dir = golden_dir();
  if (!std::filesystem::exists(dir / "golden_ids.json")) {
    GTEST_SKIP() << "golden tokenizer files not present in " << dir << " (made with HF tokenizers on a GPU machine)";
  }
  std::ifstream in(dir / "golden_ids.json");
  const json golden = json::parse(in);
  std::size_t checked = 0;
  for (const auto& [name, spec] : golden.at("tokenizers").items()) {
    const std::filesystem::path file = dir / spec.at("file").get<std::string>();
    ASSERT_TRUE(std::filesystem::exists(file)) << name << ": " << file;
    const Tokenizer tok = Tokenizer::load(file);
    EXPECT_EQ(tok.vocab_size(), spec.at("vocab_size").get<int>()) << name;
    for (const json& c : spec.at("cases")) {
      const std::string text = c.at("text").get<std::string>();
      const Ids ids_no_special = c.at("ids_no_special").get<Ids>();
      EXPECT_EQ(tok.encode(text, true), c.at("ids").get<Ids>()) << name << ": " << text;
      EXPECT_EQ(tok.encode(text, false), ids_no_special) << name << ": " << text;
      const auto tokens = c.at("tokens_no_special").get<std::vector<std::string>>();
      ASSERT_EQ(tokens.size(), ids_no_special.size()) << name << ": " << text;
      for (std::size_t k = 0; k < tokens.size(); ++k) {
        EXPECT_EQ(tok.token_to_id(tokens[k]), ids_no_special[k]) << name << ": token " << tokens[k];
        EXPECT_EQ(tok.id_to_token(ids_no_special[k]), tokens[k]) << name << ": id " << ids_no_special[k];
      }
      EXPECT_EQ(tok.decode(ids_no_special), c.at("decoded_no_special").get<std::string>()) << name << ": " << text;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0u);
}

// decode(encode(s)) == s for every golden string on the tokenizers without a normalizer (NFC
// changes decomposed text, so Qwen2-style is only checked up to NFC above).
TEST(TokenizerGolden, RoundTrip) {
  const std::filesystem::path dir = golden_dir();
  if (!std::filesystem::exists(dir / "llama3_style.json")) GTEST_SKIP() << "golden tokenizer files not present in " << dir;
  const Tokenizer tok = Tokenizer::load(dir / "llama3_style.json");
  std::ifstream in(dir / "golden_ids.json");
  const json golden = json::parse(in);
  for (const json& s : golden.at("strings")) {
    const std::string text = s.get<std::string>();
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
  }
  for (const std::string& text : hard_strings()) EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
}

// Issue 26, item 6: a hostile tokenizer.json. Nested Sequence steps recursed without a limit
// (a 0.8 MB file of nested post-processors took 3.9 GB, then crashed); added tokens were sorted
// at every insert (80k tokens: 28 s).
std::string with_step(const std::string& key, const std::string& step_text) {
  json j = make_tokenizer_json();
  j[key] = "@@STEP@@";
  std::string text = j.dump();
  text.replace(text.find("\"@@STEP@@\""), 10, step_text);
  return text;
}

std::string nested_sequence(const std::string& list_key, const std::string& leaf, int depth) {
  std::string open, close;
  for (int i = 0; i < depth; ++i) {
    open += "{\"type\":\"Sequence\",\"" + list_key + "\":[";
    close += "]}";
  }
  return open + leaf + close;
}

TEST(TokenizerIssue26, DeepNestingIsRefusedAtOnceWithANamedError) {
  const auto t0 = std::chrono::steady_clock::now();
  // 100k levels (2.4 MB): refused by the JSON nesting limit before any parsing.
  expect_error([&] { Tokenizer::from_json_text(with_step("post_processor", nested_sequence("processors", "{\"type\":\"ByteLevel\"}", 100000)), "tok.json"); },
               {"tok.json", "nested deeper than 128"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  // Within the JSON limit, each Sequence step has its own limit, named by field.
  const std::vector<std::tuple<std::string, std::string, std::string>> steps = {
      {"post_processor", "processors", "{\"type\":\"ByteLevel\"}"},
      {"normalizer", "normalizers", "{\"type\":\"NFC\"}"},
      {"pre_tokenizer", "pretokenizers", "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}"},
      {"decoder", "decoders", "{\"type\":\"ByteLevel\"}"}};
  for (const auto& [key, list, leaf] : steps) {
    SCOPED_TRACE(key);
    expect_error([&] { Tokenizer::from_json_text(with_step(key, nested_sequence(list, leaf, 20))); },
                 {key, "Sequence nested deeper than 8"});
    EXPECT_NO_THROW(Tokenizer::from_json_text(with_step(key, nested_sequence(list, leaf, 3))));
  }
}

TEST(TokenizerIssue26, ManyAddedTokensLoadInLinearTime) {
  json j = make_tokenizer_json();
  for (int i = 0; i < 80000; ++i) j["added_tokens"].push_back(added_token(1000 + i, "<t" + std::to_string(i) + ">", true));
  const std::string text = j.dump();
  const auto t0 = std::chrono::steady_clock::now();
  const Tokenizer tok = Tokenizer::from_json_text(text);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);  // was 28 s
  EXPECT_EQ(tok.encode("<t79999><t7>", false), (Ids{1000 + 79999, 1000 + 7}));
}

}  // namespace
}  // namespace kvslim::engine
