// The BPE model of a tokenizer.json ("model": {"type": "BPE", ...}): vocab, merges by rank,
// ignore_merges, byte_fallback, unk_token/fuse_unk, with a per-word cache.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/json_util.h"

namespace kvslim::engine {

// Hash/equality that let unordered_map<std::string, ...> be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // Parses and checks "model"; every merge's parts and result must be in the vocab.
  static std::unique_ptr<BpeModel> from_json(const nlohmann::json& model, const json_util::Where& where);

  // Appends the ids of one pre-tokenized word (its characters are vocab symbols).
  void encode_word(std::string_view word, std::vector<int>& out) const;

  std::optional<int> token_to_id(std::string_view token) const;
  const StringIdMap& vocab() const { return vocab_; }
  int max_id() const { return max_id_; }

 private:
  struct MergeResult {
    std::uint32_t rank;
    int id;
  };
  static std::uint64_t pair_key(int a, int b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  void merge_word(std::string_view word, std::vector<int>& out) const;

  StringIdMap vocab_;
  std::unordered_map<std::uint64_t, MergeResult> merges_;  // (left id, right id) -> rank, merged id
  std::optional<int> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int max_id_ = -1;
  std::vector<int> byte_fallback_ids_;  // <0xXX> ids, or -1 where absent; only with byte_fallback

  // Words seen before -> their ids. Bounded; guarded because encode() is const and may run on
  // several threads.
  static constexpr std::size_t kCacheCapacity = 1 << 16;
  static constexpr std::size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> cache_;
};

}  // namespace kvslim::engine
