// NaN and Inf in the forward pass (issue 13, item 7): a model whose lm_head is all NaN emitted
// token 0 every step without a word. The forward pass must stop with NonFiniteError naming the
// layer or tensor where non-finite values first appear.
#include "engine/finite_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/random_model.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Overwrites every element of f32 tensor `name` in dir/model.safetensors with `value`.
void fill_tensor(const fs::path& dir, const std::string& name, float value) {
  const fs::path file = dir / "model.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const SafetensorsHeader h =
      parse_safetensors_header(std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), "x");
  for (const TensorInfo& t : h.tensors) {
    if (t.name != name) continue;
    ASSERT_EQ(t.type, WeightType::f32);
    const std::size_t offset = static_cast<const char*>(t.data) - bytes.data();
    for (std::size_t i = 0; i < t.nbytes / 4; ++i) std::memcpy(bytes.data() + offset + 4 * i, &value, 4);
    testing::write_file(file, bytes);
    return;
  }
  FAIL() << "no tensor " << name;
}

std::string forward_error(const fs::path& dir, std::size_t prompt_tokens = 6) {
  const Model model = Model::load(dir);
  CacheSet caches = KVCacheBuilder::for_model(model.cache_spec(), KVCacheConfig{});
  Transformer t(model, caches);
  std::vector<int> prompt(prompt_tokens);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int>(i * 5 + 1);
  try {
    generate_tokens(t, prompt, GenerateOptions{.max_tokens = 4});
  } catch (const NonFiniteError& e) {
    return e.what();
  }
  return "(no NonFiniteError)";
}

class NonFinite : public ::testing::Test {
 protected:
  void SetUp() override { write_random_model(dir_.path(), RandomModelSpec{.num_layers = 3, .vocab_size = 50}); }
  TempDir dir_;
};

TEST_F(NonFinite, NanLmHeadIsNamed) {
  fill_tensor(dir_.path(), "lm_head.weight", std::numeric_limits<float>::quiet_NaN());
  const std::string e = forward_error(dir_.path());
  EXPECT_NE(e.find("'lm_head.weight' holds NaN/Inf"), std::string::npos) << e;
  EXPECT_NE(e.find("the logits"), std::string::npos) << e;
}

TEST_F(NonFinite, NanInALayerNamesTheLayerAndTensor) {
  fill_tensor(dir_.path(), "model.layers.1.mlp.down_proj.weight", std::numeric_limits<float>::quiet_NaN());
  const std::string e = forward_error(dir_.path());
  EXPECT_NE(e.find("layer 1: tensor 'model.layers.1.mlp.down_proj.weight'"), std::string::npos) << e;
}

TEST_F(NonFinite, InfKeyProjectionIsNamedBeforeTheCacheSeesIt) {
  fill_tensor(dir_.path(), "model.layers.2.self_attn.k_proj.weight", std::numeric_limits<float>::infinity());
  const std::string e = forward_error(dir_.path());
  EXPECT_NE(e.find("layer 2: tensor 'model.layers.2.self_attn.k_proj.weight'"), std::string::npos) << e;
}

TEST_F(NonFinite, NanEmbeddingIsNamed) {
  fill_tensor(dir_.path(), "model.embed_tokens.weight", std::numeric_limits<float>::quiet_NaN());
  const std::string e = forward_error(dir_.path());
  EXPECT_NE(e.find("token embeddings: tensor 'model.embed_tokens.weight'"), std::string::npos) << e;
}

TEST_F(NonFinite, OverflowWithFiniteWeightsSaysSo) {
  // Finite but huge MLP norm weights: gate x up overflows float in layer 0.
  fill_tensor(dir_.path(), "model.layers.0.post_attention_layernorm.weight", 1e30f);
  const std::string e = forward_error(dir_.path());
  EXPECT_NE(e.find("layer 0; its weights are finite"), std::string::npos) << e;
}

TEST(AllFinite, FindsEveryKindOfNonFiniteAnywhere) {
  std::vector<float> x(37, 1.5f);
  EXPECT_TRUE(all_finite(x.data(), x.size()));
  EXPECT_TRUE(all_finite(x.data(), 0));
  x[3] = std::numeric_limits<float>::max();
  x[4] = -std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(all_finite(x.data(), x.size()));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    for (std::size_t at : {std::size_t{0}, std::size_t{17}, x.size() - 1}) {
      std::vector<float> y = x;
      y[at] = bad;
      EXPECT_FALSE(all_finite(y.data(), y.size())) << bad << " at " << at;
    }
  }
}

}  // namespace
}  // namespace kvslim::engine
