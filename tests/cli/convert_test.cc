// `kvslim convert` and `--model X.gguf` as a user runs them: a random model written as GGUF
// generates what the directory generates, `info` reads it, and bad input gives one-line errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <algorithm>
#include <string>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;

using kvslim::cli_testing::Result;
Result run(const std::string& args) { return kvslim::cli_testing::run_cli(args); }

class CliConvert : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvslim_convert_" + std::to_string(getpid()));
    const Result r = run("random-model --out " + (dir_ / "hf").string() +
                         " --hidden 64 --intermediate 96 --layers 2 --heads 4 --kv-heads 2 --head-dim 16 --dtype f16 --tokenizer");
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(CliConvert, GgufGeneratesWhatTheDirectoryGenerates) {
  const std::string gguf = (dir_ / "m.gguf").string();
  Result r = run("convert " + (dir_ / "hf").string() + " " + gguf + " --type f16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote"), std::string::npos);
  const Result a = run("generate --model " + (dir_ / "hf").string() + " --prompt 'The cat sat' --max-tokens 12 --json");
  const Result b = run("generate --model " + gguf + " --prompt 'The cat sat' --max-tokens 12 --json");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(jb["prompt_tokens"], ja["prompt_tokens"]);
  EXPECT_EQ(jb["generated_ids"], ja["generated_ids"]);  // same f16 weights: the same tokens
  const Result info = run("info --json --model " + gguf);
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const auto ji = nlohmann::json::parse(info.out);
  EXPECT_EQ(ji["architecture"], "llama");
  EXPECT_EQ(ji["num_kv_heads"], 2);
  EXPECT_EQ(ji["weight_types"]["F16"].get<std::uint64_t>() > 0, true);
}

TEST_F(CliConvert, BadInputGivesOneLineErrorAndNonZeroExit) {
  const std::string gguf = (dir_ / "m.gguf").string();
  ASSERT_EQ(run("convert " + (dir_ / "hf").string() + " " + gguf).exit_code, 0);
  Result r = run("convert " + gguf + " " + (dir_ / "again.gguf").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("already a GGUF file"), std::string::npos) << r.err;
  r = run("convert " + (dir_ / "missing").string() + " " + (dir_ / "x.gguf").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("kvslim: error:"), std::string::npos) << r.err;
  r = run("convert " + (dir_ / "hf").string() + " " + (dir_ / "x.gguf").string() + " --type q3_k");
  EXPECT_NE(r.exit_code, 0);
  r = run("bench kld --model " + gguf);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--ref"), std::string::npos) << r.err;
  // A truncated GGUF: the error names the file.
  {
    std::ifstream in(gguf, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(dir_ / "cut.gguf", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  r = run("info --model " + (dir_ / "cut.gguf").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cut.gguf"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
