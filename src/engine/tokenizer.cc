#include "engine/tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <unordered_map>

#include "engine/bpe.h"
#include "engine/json_util.h"
#include "engine/model_file_limits.h"
#include "engine/pretokenizer.h"
#include "engine/utf8.h"
#include "kvslim/errors.h"

namespace kvslim::engine {
namespace {

using json_util::Json;
using json_util::Where;

struct AddedToken {
  int id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Finds added tokens in text: leftmost match, longest at that position (HF's aho-corasick
// LeftmostLongest), with the single_word / lstrip / rstrip rules.
class AddedTokenMatcher {
 public:
  // add() every token, then finish() once: one sort per list (a sort per add made 80k added
  // tokens load in 28 s: issue 26).
  void add(const AddedToken* token) {
    by_first_byte_[static_cast<unsigned char>(token->content.front())].push_back(token);
    empty_ = false;
  }
  void finish() {
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(),
                       [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
    }
  }
  bool empty() const { return empty_; }

  // Calls on_text(view) for text between tokens and on_token(id) for each token, in order.
  template <class OnText, class OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    if (empty_) {
      if (!text.empty()) on_text(text);
      return;
    }
    std::size_t emitted = 0;  // end of the last token (text before it already handed out)
    std::size_t pos = 0;
    while (pos < text.size()) {
      const AddedToken* match = longest_at(text, pos);
      if (match == nullptr) {
        ++pos;
        continue;
      }
      std::size_t start = pos, stop = pos + match->content.size();
      if (match->single_word && (ends_with_word(text.substr(0, start)) || starts_with_word(text.substr(stop)))) {
        pos = stop;  // HF skips this match and carries on after it
        continue;
      }
      if (match->lstrip) start = std::max(emitted, whitespace_start_before(text, start));
      if (match->rstrip) stop = whitespace_end_after(text, stop);
      if (start > emitted) on_text(text.substr(emitted, start - emitted));
      on_token(match->id);
      emitted = pos = stop;
    }
    if (emitted < text.size()) on_text(text.substr(emitted));
  }

 private:
  const AddedToken* longest_at(std::string_view text, std::size_t pos) const {
    for (const AddedToken* t : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      if (text.compare(pos, t->content.size(), t->content) == 0) return t;
    }
    return nullptr;
  }
  static bool is_word_char(char32_t cp) {
    if (cp == '_') return true;
    switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
      case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
      case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND:
      case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
        return true;
      default:
        return false;
    }
  }
  static std::size_t char_start_before(std::string_view s, std::size_t end) {
    std::size_t i = end - 1;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
    return i;
  }
  static bool ends_with_word(std::string_view s) {
    if (s.empty()) return false;
    std::size_t len = 0;
    return is_word_char(utf8::decode(s, char_start_before(s, s.size()), len));
  }
  static bool starts_with_word(std::string_view s) {
    if (s.empty()) return false;
    std::size_t len = 0;
    return is_word_char(utf8::decode(s, 0, len));
  }
  static std::size_t whitespace_start_before(std::string_view s, std::size_t end) {
    while (end > 0) {
      const std::size_t i = char_start_before(s, end);
      std::size_t len = 0;
      if (!utf8::is_whitespace(utf8::decode(s, i, len))) break;
      end = i;
    }
    return end;
  }
  static std::size_t whitespace_end_after(std::string_view s, std::size_t begin) {
    while (begin < s.size()) {
      std::size_t len = 0;
      if (!utf8::is_whitespace(utf8::decode(s, begin, len))) break;
      begin += len;
    }
    return begin;
  }

  std::array<std::vector<const AddedToken*>, 256> by_first_byte_{};  // each list longest first
  bool empty_ = true;
};

enum class DecoderKind { byte_level, join_with_spaces };

// A TemplateProcessing "single" entry: the sequence itself, or special token ids.
struct TemplateItem {
  bool is_sequence;
  std::vector<int> ids;
};

}  // namespace

struct Tokenizer::Impl {
  std::unique_ptr<BpeModel> model;
  std::vector<std::unique_ptr<AddedToken>> added;
  std::unordered_map<int, const AddedToken*> added_by_id;
  StringIdMap added_by_content;
  AddedTokenMatcher raw_matcher;         // added tokens with normalized == false
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized == true
  bool nfc = false;
  PreTokenizer pre_tokenizer;
  bool has_template = false;
  std::vector<TemplateItem> single_template;
  std::optional<int> bos;
  DecoderKind decoder = DecoderKind::join_with_spaces;
  std::unordered_map<int, std::string_view> vocab_by_id;  // views of the model's vocab keys
  int vocab_size = 0;

  void parse_normalizer(const Json& spec, const Where& where, int depth = 0);
  void parse_post_processor(const Json& spec, const Where& where, int depth = 0);
  void parse_decoder(const Json& spec, const Where& where, int depth = 0);
  std::string normalize(std::string_view text) const;
  void encode_text(std::string_view text, std::vector<int>& ids) const;
};

void Tokenizer::Impl::parse_normalizer(const Json& spec, const Where& where, int depth) {
  if (spec.is_null()) return;
  json_util::check_sequence_depth(depth, where);
  json_util::as_object(spec, where);
  const std::string type = json_util::as_string(json_util::require(spec, "type", where), where.field("type"));
  if (type == "Sequence") {
    const Where list_where = where.field("normalizers");
    const Json& list = json_util::as_array(json_util::require(spec, "normalizers", where), list_where);
    for (std::size_t i = 0; i < list.size(); ++i) parse_normalizer(list[i], list_where.index(i), depth + 1);
  } else if (type == "NFC") {
    nfc = true;  // NFC is idempotent, so several NFC steps are one
  } else {
    json_util::fail(where.field("type"), "unsupported normalizer '" + type + "' (supported: NFC, Sequence)");
  }
}

void Tokenizer::Impl::parse_post_processor(const Json& spec, const Where& where, int depth) {
  if (spec.is_null()) return;
  json_util::check_sequence_depth(depth, where);
  json_util::as_object(spec, where);
  const std::string type = json_util::as_string(json_util::require(spec, "type", where), where.field("type"));
  if (type == "Sequence") {
    const Where list_where = where.field("processors");
    const Json& list = json_util::as_array(json_util::require(spec, "processors", where), list_where);
    for (std::size_t i = 0; i < list.size(); ++i) parse_post_processor(list[i], list_where.index(i), depth + 1);
  } else if (type == "ByteLevel") {
    // Only adjusts offsets; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    if (has_template) json_util::fail(where, "more than one TemplateProcessing");
    has_template = true;
    const Where special_where = where.field("special_tokens");
    const Json* specials = json_util::find(spec, "special_tokens", where);
    if (specials) json_util::as_object(*specials, special_where);
    const Where single_where = where.field("single");
    const Json& single = json_util::as_array(json_util::require(spec, "single", where), single_where);
    bool seen_sequence = false;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const Where iw = single_where.index(i);
      json_util::as_object(single[i], iw);
      if (const Json* seq = json_util::find(single[i], "Sequence", iw)) {
        const std::string id = json_util::as_string(json_util::require(*seq, "id", iw.field("Sequence")), iw.field("Sequence").field("id"));
        if (id != "A") json_util::fail(iw.field("Sequence").field("id"), "a single-sequence template can only use sequence 'A', found '" + id + "'");
        single_template.push_back({true, {}});
        seen_sequence = true;
      } else if (const Json* tok = json_util::find(single[i], "SpecialToken", iw)) {
        const Where tw = iw.field("SpecialToken");
        const std::string name = json_util::as_string(json_util::require(*tok, "id", tw), tw.field("id"));
        const Json* entry = specials ? json_util::find(*specials, name, special_where) : nullptr;
        if (entry == nullptr) json_util::fail(special_where, "no entry for template token '" + name + "'");
        const Where ew = special_where.field(name);
        const Json& ids = json_util::as_array(json_util::require(*entry, "ids", ew), ew.field("ids"));
        TemplateItem item{false, {}};
        for (std::size_t k = 0; k < ids.size(); ++k) {
          const std::int64_t id = json_util::as_int(ids[k], ew.field("ids").index(k));
          if (id < 0 || id >= INT_MAX) json_util::fail(ew.field("ids").index(k), "token id out of range");
          item.ids.push_back(static_cast<int>(id));
        }
        if (!seen_sequence && !bos && !item.ids.empty()) bos = item.ids.front();
        single_template.push_back(std::move(item));
      } else {
        json_util::fail(iw, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
  } else {
    json_util::fail(where.field("type"), "unsupported post_processor '" + type + "' (supported: TemplateProcessing, ByteLevel, Sequence)");
  }
}

void Tokenizer::Impl::parse_decoder(const Json& spec, const Where& where, int depth) {
  if (spec.is_null()) return;
  json_util::check_sequence_depth(depth, where);
  json_util::as_object(spec, where);
  const std::string type = json_util::as_string(json_util::require(spec, "type", where), where.field("type"));
  if (type == "ByteLevel") {
    decoder = DecoderKind::byte_level;
  } else if (type == "Sequence") {
    const Where list_where = where.field("decoders");
    const Json& list = json_util::as_array(json_util::require(spec, "decoders", where), list_where);
    if (list.size() != 1) json_util::fail(list_where, "only a Sequence of one ByteLevel decoder is supported");
    parse_decoder(list[0], list_where.index(0), depth + 1);
  } else {
    json_util::fail(where.field("type"), "unsupported decoder '" + type + "' (supported: ByteLevel)");
  }
}

std::string Tokenizer::Impl::normalize(std::string_view text) const {
  if (!nfc) return std::string(text);
  // ASCII is already in NFC; skip utf8proc for it.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) {
    std::free(out);
    throw kvslim::InputError(std::string("NFC normalization failed: ") + utf8proc_errmsg(n));
  }
  std::string result(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
  std::free(out);
  return result;
}

void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int>& ids) const {
  auto on_token = [&](int id) { ids.push_back(id); };
  auto on_word = [&](std::string_view word) { model->encode_word(word, ids); };
  auto encode_plain = [&](std::string_view plain) { pre_tokenizer.split(plain, PreTokenizer::WordSink(on_word)); };
  // 1. tokens matched on the raw text; 2. the rest is normalized, then normalized tokens matched.
  raw_matcher.split(
      text,
      [&](std::string_view piece) {
        const std::string normalized = normalize(piece);
        normalized_matcher.split(normalized, encode_plain, on_token);
      },
      on_token);
}

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_json_text(std::string_view json, std::string_view source) {
  const Json doc = json_util::parse(json, source);
  const Where root{source, ""};
  if (!doc.is_object()) json_util::fail(root, std::string("expected a JSON object, found ") + doc.type_name());
  auto impl = std::make_shared<Impl>();

  for (const char* key : {"truncation", "padding"}) {
    if (json_util::find(doc, key, root) != nullptr) json_util::fail(root.field(key), "is not supported (expected null)");
  }
  impl->model = BpeModel::from_json(json_util::require(doc, "model", root), root.field("model"));
  impl->vocab_size = impl->model->max_id() + 1;
  impl->vocab_by_id.reserve(impl->model->vocab().size());
  for (const auto& [token, id] : impl->model->vocab()) impl->vocab_by_id.emplace(id, token);

  if (const Json* added = json_util::find(doc, "added_tokens", root)) {
    const Where aw = root.field("added_tokens");
    json_util::as_array(*added, aw);
    for (std::size_t i = 0; i < added->size(); ++i) {
      const Where w = aw.index(i);
      const Json& t = json_util::as_object((*added)[i], w);
      auto token = std::make_unique<AddedToken>();
      const std::int64_t id = json_util::as_int(json_util::require(t, "id", w), w.field("id"));
      if (id < 0 || id >= INT_MAX) json_util::fail(w.field("id"), "token id out of range: " + std::to_string(id));
      token->id = static_cast<int>(id);
      token->content = json_util::as_string(json_util::require(t, "content", w), w.field("content"));
      if (token->content.empty()) json_util::fail(w.field("content"), "must not be empty");
      if (utf8::find_invalid(token->content) != std::string_view::npos) json_util::fail(w.field("content"), "is not valid UTF-8");
      token->special = json_util::get_bool(t, "special", w, false);
      token->single_word = json_util::get_bool(t, "single_word", w, false);
      token->lstrip = json_util::get_bool(t, "lstrip", w, false);
      token->rstrip = json_util::get_bool(t, "rstrip", w, false);
      token->normalized = json_util::get_bool(t, "normalized", w, !token->special);
      if (auto [pos, inserted] = impl->added_by_content.emplace(token->content, token->id); !inserted && pos->second != token->id) {
        json_util::fail(w.field("content"), "'" + token->content + "' is already added with id " + std::to_string(pos->second));
      }
      if (auto [pos, inserted] = impl->added_by_id.emplace(token->id, token.get()); !inserted) {
        if (pos->second->content != token->content) {
          json_util::fail(w.field("id"), std::to_string(token->id) + " is already used by added token '" + pos->second->content + "'");
        }
        continue;  // an exact repeat
      }
      (token->normalized ? impl->normalized_matcher : impl->raw_matcher).add(token.get());
      impl->vocab_size = std::max(impl->vocab_size, token->id + 1);
      impl->added.push_back(std::move(token));
    }
  }

  impl->normalized_matcher.finish();
  impl->raw_matcher.finish();

  if (const Json* n = json_util::find(doc, "normalizer", root)) impl->parse_normalizer(*n, root.field("normalizer"));
  if (const Json* p = json_util::find(doc, "pre_tokenizer", root)) {
    impl->pre_tokenizer = PreTokenizer::from_json(*p, root.field("pre_tokenizer"));
  }
  if (const Json* p = json_util::find(doc, "post_processor", root)) impl->parse_post_processor(*p, root.field("post_processor"));
  if (const Json* d = json_util::find(doc, "decoder", root)) impl->parse_decoder(*d, root.field("decoder"));
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::filesystem::path& tokenizer_json) {
  return from_json_text(json_util::read_text_file(tokenizer_json, limits::kTokenizerJsonBytes), tokenizer_json.string());
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (const std::size_t bad = utf8::find_invalid(text); bad != std::string_view::npos) {
    throw kvslim::InputError("Tokenizer::encode: text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  }
  std::vector<int> ids;
  ids.reserve(text.size() / 3 + 4);
  impl_->encode_text(text, ids);
  if (!add_special_tokens || !impl_->has_template) return ids;
  std::vector<int> out;
  out.reserve(ids.size() + 4);
  for (const TemplateItem& item : impl_->single_template) {
    const std::vector<int>& part = item.is_sequence ? ids : item.ids;
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

std::string Tokenizer::token_bytes(int id, bool skip_special_tokens) const {
  if (id < 0 || id >= impl_->vocab_size) {
    throw kvslim::InputError("Tokenizer: token id " + std::to_string(id) + " is outside [0, " +
                             std::to_string(impl_->vocab_size) + ")");
  }
  std::string_view token;
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) {
    if (skip_special_tokens && it->second->special) return {};
    token = it->second->content;
  } else if (auto v = impl_->vocab_by_id.find(id); v != impl_->vocab_by_id.end()) {
    token = v->second;
    // HF skips by content: a vocab entry spelled like a special added token is special too.
    if (skip_special_tokens) {
      if (auto a = impl_->added_by_content.find(token); a != impl_->added_by_content.end() && is_special(a->second)) return {};
    }
  } else {
    return {};  // a hole in the id space
  }
  if (impl_->decoder != DecoderKind::byte_level) return std::string(token);
  // ByteLevel decoder: each character back to its byte; a token with any character outside the
  // table is taken as its own UTF-8 bytes (HF does the same).
  const ByteLevelTable& table = ByteLevelTable::get();
  std::string bytes;
  bytes.reserve(token.size());
  for (std::size_t i = 0; i < token.size();) {
    std::size_t len = 0;
    const char32_t cp = utf8::decode(token, i, len);
    if (cp >= table.char_to_byte.size() || table.char_to_byte[cp] < 0) return std::string(token);
    bytes += static_cast<char>(table.char_to_byte[cp]);
    i += len;
  }
  return bytes;
}

std::string Tokenizer::decode(std::span<const int> ids, bool skip_special_tokens) const {
  std::string bytes;
  bool first = true;
  for (int id : ids) {
    std::string piece = token_bytes(id, skip_special_tokens);
    if (impl_->decoder == DecoderKind::join_with_spaces) {  // HF: tokens.join(" ")
      if (piece.empty()) continue;
      if (!first) bytes += ' ';
    }
    bytes += piece;
    first = false;
  }
  return utf8::repair(bytes);
}

int Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) return it->second->content;
  if (auto v = impl_->vocab_by_id.find(id); v != impl_->vocab_by_id.end()) return std::string(v->second);
  return std::nullopt;
}

std::optional<int> Tokenizer::bos_id() const { return impl_->bos; }

bool Tokenizer::is_special(int id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

// ---------------------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

std::string StreamDecoder::push(int id) {
  std::string piece = tokenizer_.token_bytes(id, skip_special_);
  if (tokenizer_.impl_->decoder == DecoderKind::join_with_spaces && !piece.empty()) {
    if (!first_) pending_ += ' ';
    first_ = false;
  }
  pending_ += piece;
  const std::size_t keep = utf8::incomplete_tail(pending_);
  std::string out = utf8::repair(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvslim::engine
