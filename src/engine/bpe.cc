#include "engine/bpe.h"

#include <climits>
#include <cstdio>
#include <queue>

#include "engine/utf8.h"

namespace kvslim::engine {
namespace {

using json_util::Json;
using json_util::Where;

// A symbol of the word being merged: a doubly linked list over a vector.
struct Symbol {
  int id;
  int prev;  // index of the previous live symbol, -1 at the start
  int next;  // index of the next live symbol, -1 at the end
  bool alive;
};

// A candidate merge of symbols[pos] with its successor. Lowest rank first; on equal rank the
// leftmost position first (HF's ordering).
struct Candidate {
  std::uint32_t rank;
  int pos;
  int left_id, right_id, merged_id;
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

std::unique_ptr<BpeModel> BpeModel::from_json(const Json& model, const Where& where) {
  json_util::as_object(model, where);
  auto bpe = std::make_unique<BpeModel>();
  const std::string type = json_util::get_string(model, "type", where, "BPE");
  if (type != "BPE") json_util::fail(where.field("type"), "unsupported model type '" + type + "' (supported: BPE)");
  if (const Json* dropout = json_util::find(model, "dropout", where)) {
    if (json_util::as_number(*dropout, where.field("dropout")) != 0.0) {
      json_util::fail(where.field("dropout"), "BPE dropout is not supported (encoding must be deterministic)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!json_util::get_string(model, key, where, "").empty()) {
      json_util::fail(where.field(key), "is not supported by this byte-level BPE (expected null or \"\")");
    }
  }
  bpe->fuse_unk_ = json_util::get_bool(model, "fuse_unk", where, false);
  bpe->byte_fallback_ = json_util::get_bool(model, "byte_fallback", where, false);
  bpe->ignore_merges_ = json_util::get_bool(model, "ignore_merges", where, false);

  // vocab: token -> id, ids unique.
  const Where vocab_where = where.field("vocab");
  const Json& vocab = json_util::as_object(json_util::require(model, "vocab", where), vocab_where);
  std::unordered_map<int, const std::string*> by_id;
  bpe->vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const std::int64_t id = json_util::as_int(*it, vocab_where.field(it.key()));
    if (id < 0 || id >= INT_MAX) json_util::fail(vocab_where.field(it.key()), "token id out of range: " + std::to_string(id));
    if (utf8::find_invalid(it.key()) != std::string_view::npos) json_util::fail(vocab_where, "a token is not valid UTF-8");
    auto [pos, inserted] = by_id.emplace(static_cast<int>(id), &it.key());
    if (!inserted) {
      json_util::fail(vocab_where.field(it.key()), "id " + std::to_string(id) + " is also used by token '" + *pos->second + "'");
    }
    bpe->vocab_.emplace(it.key(), static_cast<int>(id));
    bpe->max_id_ = std::max(bpe->max_id_, static_cast<int>(id));
  }

  // merges: "a b" strings or ["a", "b"] pairs; rank = position. A repeated pair keeps the later
  // rank, as HF's HashMap collection does.
  const Where merges_where = where.field("merges");
  const Json* merges = json_util::find(model, "merges", where);
  if (merges != nullptr) {
    json_util::as_array(*merges, merges_where);
    bpe->merges_.reserve(merges->size());
    for (std::size_t rank = 0; rank < merges->size(); ++rank) {
      const Json& m = (*merges)[rank];
      const Where mw = merges_where.index(rank);
      std::string left, right;
      if (m.is_string()) {
        const std::string& line = m.get_ref<const std::string&>();
        const std::size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          json_util::fail(mw, "merge '" + line + "' must be two tokens separated by one space");
        }
        left = line.substr(0, space);
        right = line.substr(space + 1);
      } else if (m.is_array() && m.size() == 2) {
        left = json_util::as_string(m[0], mw.index(0));
        right = json_util::as_string(m[1], mw.index(1));
      } else {
        json_util::fail(mw, std::string("expected \"a b\" or [\"a\", \"b\"], found ") + m.type_name());
      }
      auto lookup = [&](const std::string& token) {
        auto it = bpe->vocab_.find(token);
        if (it == bpe->vocab_.end()) json_util::fail(mw, "merge token '" + token + "' is not in the vocab");
        return it->second;
      };
      const int a = lookup(left), b = lookup(right), merged = lookup(left + right);
      bpe->merges_.insert_or_assign(pair_key(a, b), MergeResult{static_cast<std::uint32_t>(rank), merged});
    }
  }

  const std::string unk = json_util::get_string(model, "unk_token", where, "");
  if (!unk.empty()) {
    auto it = bpe->vocab_.find(unk);
    if (it == bpe->vocab_.end()) json_util::fail(where.field("unk_token"), "'" + unk + "' is not in the vocab");
    bpe->unk_id_ = it->second;
  }
  if (bpe->byte_fallback_) {
    bpe->byte_fallback_ids_.assign(256, -1);
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = bpe->vocab_.find(std::string_view(name));
      if (it != bpe->vocab_.end()) bpe->byte_fallback_ids_[b] = it->second;
    }
  }
  return bpe;
}

std::optional<int> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::encode_word(std::string_view word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    // A word that is already a token is emitted whole (Llama-3).
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const std::size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::vector<int>(out.begin() + first, out.end()));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int>& out) const {
  // 1. One symbol per character (or per byte with byte_fallback, or unk).
  std::vector<Symbol> symbols;  // [n_symbols]
  symbols.reserve(word.size());
  bool previous_unk = false;
  auto push = [&](int id) {
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({id, index - 1, -1, true});
    if (index > 0) symbols[index - 1].next = index;
  };
  for (std::size_t i = 0; i < word.size();) {
    std::size_t len = utf8::sequence_length(static_cast<unsigned char>(word[i]));
    if (i + len > word.size()) len = word.size() - i;
    const std::string_view ch = word.substr(i, len);
    i += len;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      push(it->second);
      previous_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char b : ch) all = all && byte_fallback_ids_[b] >= 0;
      if (all) {
        for (unsigned char b : ch) push(byte_fallback_ids_[b]);
        previous_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(fuse_unk_ && previous_unk)) push(*unk_id_);
      previous_unk = true;
    }
    // Without unk_token an unknown character is dropped, as HF does.
  }
  if (symbols.empty()) return;

  // 2. Merge by lowest rank until no adjacent pair is in the merge table.
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int pos) {
    const int next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, symbols[pos].id, symbols[next].id, it->second.id});
  };
  for (int pos = 0; pos + 1 < static_cast<int>(symbols.size()); ++pos) consider(pos);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.pos];
    // Stale candidates: a side was merged away or changed since this pair was queued.
    if (!left.alive || left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != c.right_id) continue;
    left.id = c.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = c.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(c.pos);
  }
  for (int pos = 0; pos >= 0; pos = symbols[pos].next) out.push_back(symbols[pos].id);
}

}  // namespace kvslim::engine
