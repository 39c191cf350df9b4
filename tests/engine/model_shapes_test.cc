// Property test: the engine against the double-precision reference forward on random model shapes
// whose dimensions are drawn independently of each other (heads, kv_heads, head_dim, hidden,
// intermediate, weight type). Real models break the "heads x head_dim == hidden" habit (Qwen3,
// Gemma, Mistral-Nemo); a scratch buffer sized from the wrong one of these writes out of bounds,
// which ASan reports here (issue 13, item 0: the sgemm weight tile was sized for
// max(hidden, intermediate) while o_proj's rows are heads x head_dim long).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <sstream>

#include "engine/model.h"
#include "engine/random_model.h"
#include "reference_model.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;

std::string describe(const RandomModelSpec& s) {
  static const char* types[] = {"f32", "f16", "bf16"};
  std::ostringstream o;
  o << "hidden " << s.hidden_size << " intermediate " << s.intermediate_size << " heads " << s.num_heads
    << " kv_heads " << s.num_kv_heads << " head_dim " << s.head_dim << " vocab " << s.vocab_size << " "
    << types[static_cast<int>(s.dtype) % 3] << (s.tie_word_embeddings ? " tied" : "")
    << (s.attention_bias ? " bias" : "") << " seed " << s.seed;
  return o.str();
}

// One shape per seed; every dimension independent of the others (kv_heads divides heads, head_dim
// is even: the only constraints the format has).
RandomModelSpec random_shape(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RandomModelSpec s;
  s.seed = seed;
  s.num_layers = pick(1, 2);
  s.num_heads = pick(1, 8);
  std::vector<int> divisors;
  for (int d = 1; d <= s.num_heads; ++d) {
    if (s.num_heads % d == 0) divisors.push_back(d);
  }
  s.num_kv_heads = divisors[pick(0, static_cast<int>(divisors.size()) - 1)];
  s.head_dim = 2 * pick(1, 40);
  s.hidden_size = pick(4, 96);
  s.intermediate_size = pick(4, 160);
  s.vocab_size = pick(8, 80);
  const WeightType types[] = {WeightType::f32, WeightType::f16, WeightType::bf16};
  s.dtype = types[pick(0, 2)];
  s.tie_word_embeddings = pick(0, 1) == 1;
  s.attention_bias = pick(0, 1) == 1;
  return s;
}

void expect_matches_reference(const RandomModelSpec& spec, const fs::path& dir) {
  write_random_model(dir, spec, /*force=*/true);
  const Model model = Model::load(dir);
  KVCacheConfig cfg;
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), cfg);
  // max_chunk 4 < prompt: the scratch grows after construction too.
  Transformer tr(model, caches, {.max_chunk = 4, .max_context = 4});
  std::vector<int> tokens(9);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>((i * 37 + 11) % spec.vocab_size);
  // 7 tokens at once (the tiled sgemm path for 16-bit weights), then 2 decode steps (gemv).
  const auto prefill = tr.forward(std::span(tokens).first(7), {}, /*all_logits=*/true, /*prefill=*/true);
  std::vector<float> got(prefill.begin(), prefill.end());
  for (std::size_t t = 7; t < tokens.size(); ++t) {
    const auto l = tr.decode(tokens[t]);
    got.insert(got.end(), l.begin(), l.end());
  }
  const auto ref = testing::reference_logits(model, tokens, /*fp16_kv=*/true);
  ASSERT_EQ(got.size(), ref.size());
  double max_diff = 0, max_ref = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    max_diff = std::max(max_diff, std::abs(got[i] - ref[i]));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  // Same bound as model_test (fp32 sums against double, rare fp16 K/V rounding flips).
  EXPECT_LT(max_diff, 1e-3 * std::max(1.0, max_ref)) << "max |logit| " << max_ref;
}

TEST(ModelShapes, RandomShapesMatchTheReferenceForward) {
  const fs::path dir = fs::temp_directory_path() / ("kvslim_model_shapes_" + std::to_string(getpid()));
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const RandomModelSpec spec = random_shape(seed);
    SCOPED_TRACE(describe(spec));
    expect_matches_reference(spec, dir);
    if (HasFatalFailure()) break;
  }
  fs::remove_all(dir);
}

TEST(ModelShapes, QueryWidthAboveHiddenAndIntermediate) {
  // The reproduction, scaled down: heads x head_dim = 8 x 128 = 1024 > hidden 64 and
  // intermediate 64, 16-bit weights so prefill converts o_proj ([64, 1024]: 64K floats) into the
  // sgemm tile (256 rows x 64 before the fix: 16K floats).
  const fs::path dir = fs::temp_directory_path() / ("kvslim_model_wide_q_" + std::to_string(getpid()));
  for (WeightType type : {WeightType::bf16, WeightType::f16}) {
    const RandomModelSpec spec{.hidden_size = 64, .intermediate_size = 64, .num_layers = 2, .num_heads = 8,
                               .num_kv_heads = 8, .head_dim = 128, .vocab_size = 50, .dtype = type};
    SCOPED_TRACE(describe(spec));
    expect_matches_reference(spec, dir);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvslim::engine
