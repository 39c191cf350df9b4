// The score registry: scores beyond the built-in scorings of the eviction core (Scoring), each one
// file in cache/scores/ and one line in row_scores.cc. A registered score is the attention a row
// receives (accumulated as its `base` scoring does: window, pooling, normalisation, cross-layer
// importance) weighted per row by a function of the row's own key and value, computed once when
// the row arrives (the policy sees the incoming fp16 rows, never the stored ones).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvslim {

enum class Scoring;

struct RowScore {
  std::string_view name;  // its evict_scoring value
  Scoring base;           // attention or attention_normalized
  // The row's weight from its fp16 key and value [dim]; finite, >= 0.
  float (*row_weight)(const std::uint16_t* key, const std::uint16_t* value, std::size_t dim);
  std::string_view description;
};

// nullptr when `name` is no registered score.
const RowScore* find_row_score(std::string_view name);
const std::vector<RowScore>& row_scores();

}  // namespace kvslim
