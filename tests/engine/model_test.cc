// The forward pass against an independent double-precision reference written from the HF
// modeling code (no cache, no SIMD, no BLAS), on random models of each supported shape: Llama with
// GQA (f32), Qwen2 with q/k/v bias and tied embeddings (bf16), Llama 3 RoPE scaling (f16). Also:
// chunked prefill, decode steps, full_prompt vs cache_view, h2o above budget == full, loader errors.
#include "engine/model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "engine/generate.h"
#include "engine/random_model.h"
#include "kvslim/dtype.h"
#include "reference_model.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;
using testing::reference_logits;

fs::path temp_model_dir(const std::string& name) {
  return fs::temp_directory_path() / ("kvslim_model_test_" + std::to_string(getpid()) + "_" + name);
}

std::vector<int> some_tokens(int n, int vocab) {
  std::vector<int> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 37 + 11) % vocab;
  return t;
}

CacheSet caches_for(const Model& m, const std::string& method = "full",
                    std::vector<std::pair<std::string, std::string>> settings = {}) {
  KVCacheConfig cfg;
  cfg.method = method;
  for (auto& [k, v] : settings) cfg.set(k, v);
  return KVCacheBuilder::for_model(m.cache_spec(), cfg);
}

struct Case {
  std::string name;
  RandomModelSpec spec;
};

class ModelVsReference : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = temp_model_dir(GetParam().name);
    write_random_model(dir_, GetParam().spec, /*force=*/true);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(ModelVsReference, AllLogitsMatchTheDirectFormula) {
  const Model model = Model::load(dir_);
  CacheSet caches = caches_for(model);
  Transformer tr(model, caches, {.max_chunk = 4});
  const auto tokens = some_tokens(13, model.config().vocab_size);
  const auto logits = tr.forward(tokens, {}, /*all_logits=*/true, /*prefill=*/true);
  const auto ref = reference_logits(model, tokens, /*fp16_kv=*/true);
  ASSERT_EQ(logits.size(), ref.size());
  // fp32 compute against double, weights identical: differences come from fp32 rounding in sums
  // of a few hundred terms (~1e-6 relative) and rare fp16 K/V rounding flips; 1e-3 bounds both.
  double max_diff = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) max_diff = std::max(max_diff, std::abs(logits[i] - ref[i]));
  EXPECT_LT(max_diff, 1e-3);
}

TEST_P(ModelVsReference, DecodeStepsAndChunkedPrefillMatchOneShotPrefill) {
  const Model model = Model::load(dir_);
  const std::size_t vocab = model.config().vocab_size;
  const auto tokens = some_tokens(11, vocab);
  CacheSet c1 = caches_for(model);
  Transformer whole(model, c1);
  const auto all = whole.forward(tokens, {}, true, true);
  const std::vector<float> expected(all.begin(), all.end());

  // Prefill 6 in chunks of 4, then decode the remaining 5 one by one.
  CacheSet c2 = caches_for(model);
  Transformer stepwise(model, c2, {.prefill_chunk = 4});
  std::vector<float> got;
  stepwise.prefill(std::span(tokens).first(6), [&](std::size_t, std::span<const float> l) {
    got.insert(got.end(), l.begin(), l.end());
  });
  for (std::size_t t = 6; t < tokens.size(); ++t) {
    const auto l = stepwise.decode(tokens[t]);
    got.insert(got.end(), l.begin(), l.end());
  }
  EXPECT_EQ(stepwise.next_position(), 11);
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-4) << i;
}

RandomModelSpec llama3_spec() {
  RandomModelSpec s{.num_layers = 2, .num_heads = 4, .num_kv_heads = 1, .head_dim = 16, .dtype = WeightType::f16};
  s.rope_scaling = RopeScaling{"llama3", 8.0, 1.0, 4.0, 8};
  s.rope_theta = 500000;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Architectures, ModelVsReference,
    ::testing::Values(Case{"llama_gqa_f32", RandomModelSpec{}},
                      Case{"qwen2_bias_tied_bf16", RandomModelSpec{.architecture = "qwen2", .num_heads = 6,
                                                                   .num_kv_heads = 2, .head_dim = 8,
                                                                   .dtype = WeightType::bf16,
                                                                   .tie_word_embeddings = true}},
                      Case{"llama3_rope_f16", llama3_spec()}),
    [](const auto& info) { return info.param.name; });

class SmallModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_model_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    write_random_model(dir_, RandomModelSpec{.num_layers = 3, .vocab_size = 61}, /*force=*/true);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SmallModel, FullPromptEqualsCacheViewForTheFullCache) {
  const Model model = Model::load(dir_);
  const auto tokens = some_tokens(20, 61);
  CacheSet a = caches_for(model), b = caches_for(model);
  Transformer view(model, a, {.prefill_chunk = 7});
  Transformer full(model, b, {.prefill_attention = PrefillAttention::full_prompt, .prefill_chunk = 7});
  const auto la = view.prefill(tokens);
  const std::vector<float> first(la.begin(), la.end());
  const auto lb = full.prefill(tokens);
  for (std::size_t i = 0; i < first.size(); ++i) ASSERT_NEAR(first[i], lb[i], 1e-5);
}

TEST_F(SmallModel, FullPromptDiffersFromCacheViewWhenTheCacheEvicts) {
  // h2o with budget 6 evicts while a 20-token chunk prefills: cache_view queries lose rows that
  // full_prompt queries still see, so the last logits differ.
  const Model model = Model::load(dir_);
  const auto tokens = some_tokens(20, 61);
  const std::vector<std::pair<std::string, std::string>> h2o = {{"h2o_budget", "6"}, {"h2o_n_sink", "2"}, {"evict_profile", "original"}};
  CacheSet a = caches_for(model, "h2o", h2o), b = caches_for(model, "h2o", h2o);
  Transformer view(model, a);
  Transformer full(model, b, {.prefill_attention = PrefillAttention::full_prompt});
  const auto la = view.prefill(tokens);
  const std::vector<float> first(la.begin(), la.end());
  const auto lb = full.prefill(tokens);
  double diff = 0;
  for (std::size_t i = 0; i < first.size(); ++i) diff = std::max(diff, static_cast<double>(std::abs(first[i] - lb[i])));
  EXPECT_GT(diff, 1e-3);
  EXPECT_EQ(a.at(0).stats().tokens_kept, 6u);
}

TEST_F(SmallModel, GenerateWithH2oAboveTheSequenceLengthEqualsFull) {
  const Model model = Model::load(dir_);
  const auto prompt = some_tokens(9, 61);
  GenerateOptions opts{.max_tokens = 12, .sampler = {.temperature = 0.8f, .top_k = 20, .seed = 5}};
  CacheSet full = caches_for(model);
  Transformer tf(model, full);
  const auto a = generate_tokens(tf, prompt, opts);
  for (const std::string scoring : {"key_proxy", "attention"}) {
    CacheSet h2o = caches_for(model, "h2o", {{"h2o_budget", "64"}, {"evict_scoring", scoring}});
    Transformer th(model, h2o);
    const auto b = generate_tokens(th, prompt, opts);
    EXPECT_EQ(a.generated_ids, b.generated_ids) << scoring;
    EXPECT_EQ(h2o.at(1).stats().tokens_kept, 9u + 11u);  // the last sampled token is never fed back
  }
  EXPECT_EQ(a.generated_ids.size(), 12u);
  EXPECT_GT(a.decode_tokens_per_second(), 0);
}

TEST_F(SmallModel, GenerateStopsAtEosAndIsDeterministicPerSeed) {
  const Model model = Model::load(dir_);
  const auto prompt = some_tokens(5, 61);
  CacheSet c = caches_for(model);
  Transformer t(model, c);
  GenerateOptions opts{.max_tokens = 8};  // greedy
  const auto greedy = generate_tokens(t, prompt, opts);
  t.reset();
  opts.stop_ids = {greedy.generated_ids[2]};
  const auto stopped = generate_tokens(t, prompt, opts);
  EXPECT_TRUE(stopped.stopped_at_eos);
  EXPECT_EQ(stopped.generated_ids,
            std::vector<int>(greedy.generated_ids.begin(),
                             std::find(greedy.generated_ids.begin(), greedy.generated_ids.end(), opts.stop_ids[0]) + 1));
  EXPECT_EQ(t.next_position(), 5 + static_cast<std::int64_t>(stopped.generated_ids.size()) - 1);
}

TEST_F(SmallModel, ObservationHooksRunForMethodsThatAskForThem) {
  // squeeze with the hidden-state signal and attention scoring asks for both hooks.
  const Model model = Model::load(dir_);
  const auto tokens = some_tokens(24, 61);
  for (auto mode : {PrefillAttention::cache_view, PrefillAttention::full_prompt}) {
    CacheSet c = caches_for(model, "squeeze",
                            {{"squeeze_budget", "10"}, {"squeeze_n_sink", "2"}, {"squeeze_signal", "hidden_cosine"},
                             {"evict_scoring", "attention"}});
    ASSERT_TRUE(c.at(0).needs().attention);
    ASSERT_TRUE(c.at(0).needs().hidden_states);
    Transformer t(model, c, {.prefill_attention = mode, .prefill_chunk = 8});
    const auto l = t.prefill(tokens);
    for (float x : l) ASSERT_TRUE(std::isfinite(x));
    for (int i = 0; i < 4; ++i) t.decode(i);
    EXPECT_LT(c.resident_bytes(), c.seen_fp16_bytes());
  }
}

TEST_F(SmallModel, RejectsBadTokensPositionsAndCacheSets) {
  const Model model = Model::load(dir_);
  CacheSet c = caches_for(model);
  Transformer t(model, c);
  const std::vector<int> bad = {3, 61};
  EXPECT_THROW(t.forward(bad), std::invalid_argument);
  const std::vector<int> two = {1, 2};
  const std::vector<std::int64_t> backwards = {5, 4};
  EXPECT_THROW(t.forward(two, backwards), std::invalid_argument);
  EXPECT_THROW(t.forward(std::span<const int>()), std::invalid_argument);
  CacheSet wrong = KVCacheBuilder::for_model(ModelSpec::uniform(2, 2, 16), KVCacheConfig{});
  EXPECT_THROW(Transformer(model, wrong), std::invalid_argument);
}

TEST_F(SmallModel, ParameterCountAndDecodeBytes) {
  const Model model = Model::load(dir_);
  // embed 61*64, lm_head 61*64, norm 64; per layer: 2*64 norms, q 64*64, k,v 32*64, o 64*64,
  // gate/up/down 3 * 160*64.
  const std::uint64_t per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 160 * 64;
  EXPECT_EQ(model.parameter_count(), 2u * 61 * 64 + 64 + 3 * per_layer);
  EXPECT_EQ(model.decode_weight_bytes(), 4u * (61 * 64 + 3 * (per_layer - 2 * 64)));
}

TEST(ModelLoad, MissingOrMisshapenTensorNamesTheTensor) {
  const fs::path dir = temp_model_dir("broken");
  // Config says 3 layers, the weights have 2.
  write_random_model(dir, RandomModelSpec{.num_layers = 2}, /*force=*/true);
  {
    std::ifstream in(dir / "config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find("\"num_hidden_layers\": 2"), 22, "\"num_hidden_layers\": 3");
    std::ofstream(dir / "config.json") << text;
  }
  try {
    Model::load(dir);
    ADD_FAILURE() << "expected ModelFileError";
  } catch (const ModelFileError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.2."), std::string::npos) << e.what();
  }
  // Config says an intermediate size the tensors do not have.
  write_random_model(dir, RandomModelSpec{.intermediate_size = 100}, /*force=*/true);
  {
    std::ifstream in(dir / "config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find("\"intermediate_size\": 100"), 24, "\"intermediate_size\": 101");
    std::ofstream(dir / "config.json") << text;
  }
  try {
    Model::load(dir);
    ADD_FAILURE() << "expected ModelFileError";
  } catch (const ModelFileError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate_proj.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvslim::engine
