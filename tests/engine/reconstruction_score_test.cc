// Reconstruction scores (engine/reconstruction_score.h): the context re-read chunk by chunk after
// a repeat prompt; every context position scored per layer and KV head by the largest attention a
// copy query gave it.
#include "engine/reconstruction_score.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "eval_test_util.h"

namespace kvslim::engine {
namespace {

std::vector<int> some_context(std::size_t n) {
  std::vector<int> ids;
  ids.push_back(eval::testing::kBos);
  for (std::size_t i = 1; i < n; ++i) ids.push_back(static_cast<int>('a' + (i * 7) % 26));
  return ids;
}

TEST(ReconstructionScore, ScoresEveryPositionOfEveryLayerAndHead) {
  const Model& model = eval::testing::small_model();
  const std::vector<int> context = some_context(100);
  ReconstructionOptions o;
  o.repeat_prompt = eval::testing::byte_encode("\nRepeat:\n");
  o.chunk = 32;  // four chunks, the last one short
  o.weight = 2.5f;
  const auto scores = reconstruction_scores(model, context, o);
  ASSERT_EQ(scores.size(), static_cast<std::size_t>(model.config().num_layers));
  const std::size_t group = static_cast<std::size_t>(model.config().num_heads / model.config().num_kv_heads);
  for (const auto& s : scores) {
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->heads, static_cast<std::size_t>(model.config().num_kv_heads));
    EXPECT_EQ(s->length, context.size());
    EXPECT_EQ(s->weight, 2.5f);
    ASSERT_EQ(s->values.size(), s->heads * s->length);
    // A max of probabilities summed over a query group: in [0, group], and every position was
    // visible to every copy query, so none is left at exactly 0.
    for (float v : s->values) {
      EXPECT_GT(v, 0.0f);
      EXPECT_LE(v, static_cast<float>(group) + 1e-5f);
    }
  }
  // The chunking changes which rows a copy query sees besides the context (its own chunk), not
  // the context's scores' shape; one chunk covering everything also works.
  o.chunk = 1000;
  const auto whole = reconstruction_scores(model, context, o);
  EXPECT_EQ(whole[0]->values.size(), scores[0]->values.size());
}

TEST(ReconstructionScore, BadInputIsRefused) {
  const Model& model = eval::testing::small_model();
  ReconstructionOptions o;
  EXPECT_THROW(reconstruction_scores(model, {}, o), std::invalid_argument);
  o.chunk = 0;
  const std::vector<int> context = some_context(20);
  EXPECT_THROW(reconstruction_scores(model, context, o), std::invalid_argument);
  // The chunks run after the context: a context near the model's limit is refused up front.
  o.chunk = 64;
  const std::vector<int> long_context = some_context(static_cast<std::size_t>(model.config().max_position_embeddings) - 10);
  EXPECT_THROW(reconstruction_scores(model, long_context, o), ContextLengthError);
}

}  // namespace
}  // namespace kvslim::engine
