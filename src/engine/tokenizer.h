// Byte-level BPE tokenizer from an HF tokenizer.json, encoding exactly as HF tokenizers does:
// added tokens split out first, normalizer (NFC), pre-tokenizer (regex split + ByteLevel), BPE by
// merge rank, post-processor template; decoding through the ByteLevel decoder.
#pragma once
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model_file_error.h"

namespace kvslim::engine {

class Tokenizer {
 public:
  static Tokenizer load(const std::filesystem::path& tokenizer_json);  // throws ModelFileError
  // Parses tokenizer.json text (the fuzz entry point); `source` names it in error messages.
  static Tokenizer from_json_text(std::string_view json, std::string_view source = "tokenizer.json");

  // `text` must be valid UTF-8 (kvslim::InputError otherwise). With add_special_tokens the
  // post-processor's template (e.g. Llama-3's <|begin_of_text|>) is applied.
  std::vector<int> encode(std::string_view text, bool add_special_tokens = true) const;
  // Ids without a token (holes in the id space) decode to nothing, as in HF; ids outside
  // [0, vocab_size()) throw kvslim::InputError. Invalid UTF-8 becomes U+FFFD.
  std::string decode(std::span<const int> ids, bool skip_special_tokens = false) const;
  // One more than the largest id of the vocab and the added tokens.
  int vocab_size() const;
  std::optional<int> token_to_id(std::string_view token) const;
  // The token's string as in tokenizer.json (byte-level characters), or nullopt for a hole.
  std::optional<std::string> id_to_token(int id) const;
  std::optional<int> bos_id() const;  // from the post-processor template, if any
  bool is_special(int id) const;      // an added token marked "special"

  // The raw bytes one token decodes to (possibly part of a UTF-8 character), or "" for a
  // skipped special token / a hole. Throws kvslim::InputError outside [0, vocab_size()).
  std::string token_bytes(int id, bool skip_special_tokens = false) const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend class StreamDecoder;
};

// Streaming detokenizer: returns only complete UTF-8 characters; bytes of a character split over
// tokens are held until it is complete (flush() repairs what is left).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(int id);
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;  // bytes of an unfinished character
};

}  // namespace kvslim::engine
