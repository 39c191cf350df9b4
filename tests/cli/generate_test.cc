// `kvslim generate`, `kvslim info` and `kvslim random-model` as a user runs them: exit codes,
// JSON output, streaming output, and one-line errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>
#include <algorithm>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;

using kvslim::cli_testing::Result;
using kvslim::cli_testing::run_cli;

class CliGenerate : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("kvslim_cli_model_" + std::to_string(getpid())));
    const Result r = run_cli("random-model --out " + dir_->string() +
                             " --hidden 48 --intermediate 96 --layers 2 --heads 4 --kv-heads 2 --head-dim 12 --dtype f16");
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static nlohmann::json generate_json(const std::string& extra) {
    const Result r = run_cli("generate --model " + dir_->string() + " --prompt 'The cat sat' --json " + extra);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  }
  static fs::path* dir_;
};
fs::path* CliGenerate::dir_ = nullptr;

TEST_F(CliGenerate, InfoDescribesTheModel) {
  const Result r = run_cli("info --json --model " + dir_->string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["architecture"], "llama");
  EXPECT_EQ(j["num_layers"], 2);
  EXPECT_EQ(j["num_kv_heads"], 2);
  EXPECT_EQ(j["head_dim"], 12);
  EXPECT_EQ(j["tokenizer_vocab"], 258);
  EXPECT_EQ(j["weight_types"]["F16"], j["parameters"]);
  EXPECT_EQ(j["special_tokens"]["bos"]["text"], "<s>");
  EXPECT_EQ(j["special_tokens"]["eos"][0]["id"], 257);
  const Result text = run_cli("info --model " + dir_->string());
  EXPECT_NE(text.out.find("parameters:"), std::string::npos) << text.out;
}

TEST_F(CliGenerate, H2oAboveTheLengthGeneratesWhatFullGenerates) {
  const auto full = generate_json("--max-tokens 10");
  const auto h2o = generate_json("--max-tokens 10 --method h2o --set h2o_budget=100");
  EXPECT_EQ(full["prompt_tokens"], 12);  // BOS + 11 bytes
  EXPECT_EQ(full["generated_ids"], h2o["generated_ids"]);
  EXPECT_EQ(full["layers"].size(), 2u);
  EXPECT_EQ(full["layers"][1]["tokens_kept"], 12 + 9);
  EXPECT_GT(full["decode_tokens_per_second"].get<double>(), 0);
}

TEST_F(CliGenerate, SmallBudgetHoldsLessThanFp16AndSamplingRepeatsPerSeed) {
  const auto a = generate_json("--max-tokens 24 --method h2o --set h2o_budget=6 --set h2o_n_sink=2 "
                               "--temperature 0.9 --top-p 0.9 --seed 4");
  const auto b = generate_json("--max-tokens 24 --method h2o --set h2o_budget=6 --set h2o_n_sink=2 "
                               "--temperature 0.9 --top-p 0.9 --seed 4");
  EXPECT_EQ(a["generated_ids"], b["generated_ids"]);
  EXPECT_EQ(a["text"], b["text"]);
  EXPECT_EQ(a["layers"][0]["tokens_kept"], 6);
  EXPECT_LT(a["kv_resident_bytes"].get<double>(), a["kv_fp16_equivalent_bytes"].get<double>());
}

TEST_F(CliGenerate, StreamsTextThenReportsThroughputAndBytes) {
  const Result r = run_cli("generate --model " + dir_->string() +
                           " --prompt hi --max-tokens 5 --prefill-attention full_prompt --method streaming"
                           " --set streaming_budget=4 --set streaming_n_sink=1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("tok/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layer   1:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bytes resident vs"), std::string::npos) << r.out;
}

TEST_F(CliGenerate, BadInputGivesOneLineErrorAndNonZeroExit) {
  for (const std::string& args : std::vector<std::string>
       {"generate --model " + dir_->string() + " --prompt x --set h2o_budget",
        "generate --model " + dir_->string() + " --prompt x --set no_such_field=1",
        "generate --model " + dir_->string() + " --prompt x --method h2o --set h2o_budget=-3",
        "generate --model " + dir_->string() + " --prompt x --top-p 0",
        std::string("generate --model /nonexistent/model --prompt x"), std::string("info --model /nonexistent/model")}) {
    const Result r = run_cli(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(r.err.rfind("kvslim: error: ", 0), 0u) << args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
