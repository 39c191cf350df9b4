#include "cache/row_scores.h"

#include "cache/eviction_core.h"

namespace kvslim {
namespace scores {
// One declaration per score file of cache/scores/.
float value_norm_weight(const std::uint16_t* key, const std::uint16_t* value, std::size_t dim);
}  // namespace scores

const std::vector<RowScore>& row_scores() {
  // One line per score.
  static const std::vector<RowScore> table = {
      {"value_norm_attention", Scoring::attention_normalized, &scores::value_norm_weight,
       "normalised attention x the L1 norm of the row's value (VATP)"},
  };
  return table;
}

const RowScore* find_row_score(std::string_view name) {
  for (const RowScore& s : row_scores()) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

}  // namespace kvslim
