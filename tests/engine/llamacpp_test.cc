// llama.cpp (the pinned build, bench/llamacpp/build_llamacpp.sh) loads the GGUF kvslim writes of
// models/mini and reproduces the HF golden logits (tests/golden/mini). Runs only where that build
// was present when cmake configured (not in CI); skips with a message otherwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/gguf_model.h"
#include "engine/json_util.h"
#include "engine/model.h"
#include "engine/model_file_limits.h"
#include "engine/ops.h"
#include "engine/random_model.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;

using testing::source_dir;

#ifdef KVSLIM_LLAMACPP_LOGITS
std::vector<float> read_f32(const fs::path& p, std::size_t n) {
  std::vector<float> v(n);
  std::ifstream in(p, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_TRUE(in) << p;
  return v;
}
#endif

TEST(LlamaCpp, LoadsKvslimGgufOfMiniAndReproducesHfGoldenLogits) {
#ifndef KVSLIM_LLAMACPP_LOGITS
  GTEST_SKIP() << "llama.cpp build not found: run bench/llamacpp/build_llamacpp.sh, then re-run cmake";
#else
  const fs::path dir = source_dir() / "models/mini", golden_dir = source_dir() / "tests/golden/mini";
  if (!fs::exists(dir / "config.json") || !fs::exists(golden_dir / "golden.json")) GTEST_SKIP() << "models/mini not present";
  testing::TempDir tmp;
  // F32 matrices (the bf16 weights exactly), so llama.cpp computes in fp32 as the HF reference did.
  const Model hf = Model::load(dir);
  write_gguf(hf, json_util::read_text_file(dir / "tokenizer.json", limits::kTokenizerJsonBytes), tmp / "mini.gguf", {.matrix_type = gguf::TensorType::f32});
  const nlohmann::json golden = nlohmann::json::parse(json_util::read_text_file(golden_dir / "golden.json", limits::kTokenizerJsonBytes));
  const std::size_t vocab = hf.config().vocab_size;
  for (const auto& w : golden["windows"]) {
    const auto ids = w["input_ids"].get<std::vector<int>>();
    std::string cmd = KVSLIM_LLAMACPP_LOGITS;
    for (const std::string& arg : {(tmp / "mini.gguf").string(), (tmp / "out.f32").string(), std::string("f32")}) cmd.append(" ").append(arg);
    for (int id : ids) cmd.append(" ").append(std::to_string(id));
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd.substr(0, 200);
    const std::vector<float> all = read_f32(tmp / "out.f32", ids.size() * vocab);
    const auto positions = w["logit_positions"].get<std::vector<std::size_t>>();
    const std::vector<float> ref = read_f32(golden_dir / w["logits_file"].get<std::string>(), positions.size() * vocab);
    double max_diff = 0;
    for (std::size_t k = 0; k < positions.size(); ++k) {
      for (std::size_t v = 0; v < vocab; ++v) {
        max_diff = std::max(max_diff, static_cast<double>(std::abs(all[positions[k] * vocab + v] - ref[k * vocab + v])));
      }
    }
    // fp32 weights and KV in both: only summation order differs (logits ~10).
    EXPECT_LT(max_diff, 2e-3) << ids.size() << "-token window";
    const auto ref_argmax = w["argmax_all_positions"].get<std::vector<int>>();
    std::size_t same = 0;
    for (std::size_t s = 0; s < ids.size(); ++s) {
      const float* row = all.data() + s * vocab;
      same += static_cast<int>(std::max_element(row, row + vocab) - row) == ref_argmax[s];
    }
    EXPECT_GE(same, ids.size() * 99 / 100);
    std::printf("llama.cpp on kvslim's GGUF, %zu-token window: max |logit - HF| %.3g, argmax %zu/%zu\n", ids.size(), max_diff,
                same, ids.size());
  }
#endif
}

// The same block-quantized GGUF in both engines: kvslim's decoding of every block format (Q8_0,
// Q4_0, Q4_K, Q5_K, Q6_K and the Q4_K_M mix) gives llama.cpp's logits, up to the activation
// rounding llama.cpp applies in its products (q8_0 / q8_K activations; kvslim's prompt products are
// fp32). A misread block (scale, nibble order, high bits, sub-block scales) moves logits by their
// own size, far past the tolerance.
class LlamaCppQuant : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCppQuant, SameQuantizedFileGivesLlamaCppLogits) {
#ifndef KVSLIM_LLAMACPP_LOGITS
  GTEST_SKIP() << "llama.cpp build not found: run bench/llamacpp/build_llamacpp.sh, then re-run cmake";
#else
  testing::TempDir tmp;
  RandomModelSpec spec;
  spec.hidden_size = 256;
  spec.intermediate_size = 512;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.vocab_size = 300;
  spec.byte_tokenizer = true;
  spec.seed = 11;
  write_random_model(tmp / "hf", spec);
  const Model hf = Model::load(tmp / "hf");
  GgufExportOptions options;
  const std::string type = GetParam();
  if (type == "q4_k_m") {
    options.matrix_type = gguf::TensorType::q4_k;
    options.override_type = [](const std::string& name, gguf::TensorType t) {
      return name == "output.weight" || name.ends_with(".ffn_down.weight") ? gguf::TensorType::q6_k : t;
    };
  } else {
    options.matrix_type = parse_tensor_type(type);
  }
  write_gguf(hf, json_util::read_text_file(tmp / "hf/tokenizer.json", limits::kTokenizerJsonBytes), tmp / "m.gguf", options);
  const Model q = Model::load(tmp / "m.gguf");
  ASSERT_TRUE(is_block_type(q.weights().layers[0].w_up.type));
  std::vector<int> ids;
  for (int i = 0; i < 24; ++i) ids.push_back((i * 37 + 5) % 256);
  std::string cmd = KVSLIM_LLAMACPP_LOGITS;
  for (const std::string& arg : {(tmp / "m.gguf").string(), (tmp / "out.f32").string(), std::string("f32")}) cmd.append(" ").append(arg);
  for (int id : ids) cmd.append(" ").append(std::to_string(id));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd.substr(0, 200);
  const std::size_t vocab = q.config().vocab_size;
  const std::vector<float> ref = read_f32(tmp / "out.f32", ids.size() * vocab);
  CacheSet caches = KVCacheBuilder::for_model(q.cache_spec(), KVCacheConfig{});
  Transformer t(q, caches);
  const auto got = t.forward(ids, {}, /*all_logits=*/true, /*prefill=*/true);
  double max_diff = 0, max_logit = 0;
  std::size_t same = 0;
  for (std::size_t s = 0; s < ids.size(); ++s) {
    for (std::size_t v = 0; v < vocab; ++v) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[s * vocab + v]) - ref[s * vocab + v]));
      max_logit = std::max(max_logit, std::fabs(static_cast<double>(ref[s * vocab + v])));
    }
    const float* a = got.data() + s * vocab;
    const float* b = ref.data() + s * vocab;
    same += (std::max_element(a, a + vocab) - a) == (std::max_element(b, b + vocab) - b);
  }
  std::printf("%s: max |kvslim - llama.cpp| %.3g of max |logit| %.3g, argmax %zu/%zu\n", type.c_str(), max_diff, max_logit, same,
              ids.size());
  EXPECT_LT(max_diff, 0.03 * max_logit);
  EXPECT_GE(same, ids.size() * 3 / 4);
  // The same tokens one at a time: decode's matrix-vector kernels (quant_gemv's gemv_rows), not
  // prefill's tiles, against the same llama.cpp logits.
  CacheSet caches1 = KVCacheBuilder::for_model(q.cache_spec(), KVCacheConfig{});
  Transformer t1(q, caches1);
  double max_diff1 = 0;
  std::size_t same1 = 0;
  for (std::size_t s = 0; s < ids.size(); ++s) {
    const auto step = t1.decode(ids[s]);
    ASSERT_EQ(step.size(), vocab);
    for (std::size_t v = 0; v < vocab; ++v) {
      max_diff1 = std::max(max_diff1, std::fabs(static_cast<double>(step[v]) - ref[s * vocab + v]));
    }
    const float* b = ref.data() + s * vocab;
    same1 += (std::max_element(step.begin(), step.end()) - step.begin()) == (std::max_element(b, b + vocab) - b);
  }
  std::printf("%s, token by token (decode kernels): max |kvslim - llama.cpp| %.3g, argmax %zu/%zu\n", type.c_str(), max_diff1,
              same1, ids.size());
  EXPECT_LT(max_diff1, 0.03 * max_logit);
  EXPECT_GE(same1, ids.size() * 3 / 4);
#endif
}

INSTANTIATE_TEST_SUITE_P(Formats, LlamaCppQuant, ::testing::Values("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m"));

}  // namespace
}  // namespace kvslim::engine
