// llama.cpp (the pinned build, bench/llamacpp/build_llamacpp.sh) loads the GGUF kvslim writes of
// models/mini and reproduces the HF golden logits (tests/golden/mini). Runs only where that build
// was present when cmake configured (not in CI); skips with a message otherwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/gguf_model.h"
#include "engine/json_util.h"
#include "engine/model.h"
#include "engine/model_file_limits.h"
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

}  // namespace
}  // namespace kvslim::engine
