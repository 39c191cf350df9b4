// The CLI reproductions of issue 13 ("hostile and careless input"), each as the user ran it:
// every one must end in rc 0 with the right output, or a one-line "kvslim: error: ..." naming
// what is wrong and a non-zero exit -- never a signal, a hang or a silent success.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;
using kvslim::cli_testing::Result;
using kvslim::cli_testing::run_cli;

// A failure as the CLI must report it: exited (no signal), non-zero, one line naming `fragment`.
void expect_one_line_error(const Result& r, const std::string& fragment, const std::string& what) {
  EXPECT_NE(r.exit_code, -1) << what << ": killed by a signal\n" << r.err;
  EXPECT_NE(r.exit_code, 0) << what;
  EXPECT_EQ(r.err.rfind("kvslim: error: ", 0), 0u) << what << "\n" << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << "\n" << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << what << ": '" << fragment << "' not in\n" << r.err;
}

class CliHostile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() / ("kvslim_cli_hostile_" + std::to_string(getpid())));
    fs::create_directories(*root_);
    const Result r = run_cli("random-model --out " + model().string() +
                             " --hidden 32 --intermediate 64 --layers 2 --heads 2 --kv-heads 1 --head-dim 16"
                             " --max-positions 64 --dtype f32");
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path model() { return *root_ / "model"; }
  static fs::path path(const std::string& name) { return *root_ / name; }
  static fs::path* root_;
};
fs::path* CliHostile::root_ = nullptr;

// Item 0: heads x head_dim (1024) > hidden (256): prefill wrote past the sgemm weight tile
// ("double free or corruption", rc 134).
TEST_F(CliHostile, QueryWiderThanHiddenGeneratesCleanly) {
  const fs::path dir = path("wide_q");
  Result r = run_cli("random-model --out " + dir.string() +
                     " --hidden 256 --intermediate 512 --layers 2 --heads 8 --kv-heads 8 --head-dim 128 --vocab 512 --tokenizer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_cli("generate --model " + dir.string() + " --prompt 'hello there' --max-tokens 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["generated_tokens"], 4);
}

// Item 5: bench zipcache with a zero block length or a hi_fraction outside [0, 1] crashed.
TEST_F(CliHostile, BenchZipcacheRefusesBadSweepValues) {
  for (const std::string& args :
       {std::string("--seq 0"), std::string("--hi-fraction 1.5"), std::string("--hi-fraction=-0.5"),
        std::string("--hi-fraction nan")}) {
    const Result r = run_cli("bench zipcache " + args + " --gen-steps 1");
    expect_one_line_error(r, args.substr(0, args.find_first_of(" =")), args);
  }
}

// bench engine: a method's own options (name@key=value,...) are checked before the model loads,
// and --shared-prefill reports every method from one prefill (one prefill figure, JSON says whose).
TEST_F(CliHostile, BenchEngineMethodOptionsAndSharedPrefill) {
  for (const auto& [method, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"kivo", "unknown method 'kivo'"}, {"kivi@kivi_bits=9", "kivi_bits"}, {"kivi@bits", "'bits'"}}) {
    expect_one_line_error(run_cli("bench engine --model " + model().string() + " --method " + method), fragment, method);
  }
  const fs::path json = path("engine.json");
  const Result r = run_cli("bench engine --model " + model().string() +
                           " --context 48 --method full kivi@kivi_bits=4 h2o --set h2o_budget=16 --decode-tokens 4"
                           " --repeats 1 --threads 1 --prefill-threads 2 --shared-prefill --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(json);
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_EQ(j["runs"].size(), 3u);
  for (const auto& run : j["runs"]) {
    EXPECT_EQ(run["prefill_shared_with"], "full");
    EXPECT_EQ(run["prefill_tokens_per_s"], j["runs"][0]["prefill_tokens_per_s"]);
    EXPECT_GT(run["decode_tokens_per_s"].get<double>(), 0.0);
  }
  EXPECT_EQ(j["runs"][1]["method"], "kivi@kivi_bits=4");
  EXPECT_NE(j["runs"][1]["kv_resident_bytes"], j["runs"][0]["kv_resident_bytes"]);
  // h2o keeps 16 of the 48 rows: it was filled, and evicted, by the shared prefill.
  EXPECT_LT(j["runs"][2]["kv_resident_bytes"].get<double>(), j["runs"][0]["kv_resident_bytes"].get<double>());
  EXPECT_EQ(j["heap"], "warm");  // the default: runs after the first reuse touched pages
  const Result cold = run_cli("bench engine --model " + model().string() +
                              " --context 16 --method full --decode-tokens 2 --repeats 1 --threads 1 --heap cold --json " +
                              json.string());
  ASSERT_EQ(cold.exit_code, 0) << cold.err;
  std::ifstream g(json);
  EXPECT_EQ(nlohmann::json::parse(g)["heap"], "cold");
  expect_one_line_error(run_cli("bench engine --model " + model().string() + " --heap lukewarm"), "--heap", "heap mode");
}

// Item 6: a config.json linked to /dev/zero grew to 12 GB before failing.
TEST_F(CliHostile, ConfigLinkedToDevZero) {
  const fs::path dir = path("devzero");
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(model())) fs::copy(e.path(), dir / e.path().filename());
  fs::remove(dir / "config.json");
  fs::create_symlink("/dev/zero", dir / "config.json");
  const Result r = run_cli("generate --model " + dir.string() + " --prompt hi --max-tokens 1");
  expect_one_line_error(r, "config.json: is a device", "config.json -> /dev/zero");
}

// Item 8: generation ran past max_position_embeddings with rc 0; now refused unless allowed.
TEST_F(CliHostile, PastMaxPositionsNeedsTheFlag) {
  const std::string base = "generate --model " + model().string() + " --prompt 'The cat sat on the mat' --json";
  // 23 prompt tokens (BOS + 22 bytes) + 50 new > 64 positions.
  Result r = run_cli(base + " --max-tokens 50");
  expect_one_line_error(r, "max_position_embeddings 64", "past max positions");
  EXPECT_NE(r.err.find("--allow-long-context"), std::string::npos) << r.err;
  r = run_cli(base + " --max-tokens 50 --allow-long-context");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["generated_tokens"], 50);
  r = run_cli(base + " --max-tokens 20");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// Item 10: unsigned flags took -1 as 2^64 - 1.
TEST_F(CliHostile, NegativeValuesForUnsignedFlagsAreRefused) {
  for (const std::string& flag : {std::string("--prefill-chunk"), std::string("--seed")}) {
    const Result r = run_cli("generate --model " + model().string() + " --prompt hi " + flag + " -1");
    expect_one_line_error(r, flag, flag + " -1");
  }
  const Result r = run_cli("random-model --out " + path("neg_seed").string() + " --seed -1");
  expect_one_line_error(r, "--seed", "random-model --seed -1");
  EXPECT_FALSE(fs::exists(path("neg_seed")));
}

// Item 10: random-model wrote an odd head_dim that generate then rejected.
TEST_F(CliHostile, RandomModelRefusesWhatTheEngineCannotRun) {
  Result r = run_cli("random-model --out " + path("odd").string() + " --head-dim 3");
  expect_one_line_error(r, "head_dim must be even", "--head-dim 3");
  EXPECT_FALSE(fs::exists(path("odd") / "config.json"));
  r = run_cli("random-model --out " + path("gqa").string() + " --heads 6 --kv-heads 4");
  expect_one_line_error(r, "must be a multiple of num_kv_heads 4", "--heads 6 --kv-heads 4");
}

// Item 10: a long prompt could not be passed at all; --prompt-file FILE and - (stdin).
TEST_F(CliHostile, PromptFromFileOrStdinEqualsPromptFlag) {
  const std::string prompt = "A prompt with 'quotes', $dollars and\nnewlines";
  std::ofstream(path("prompt.txt"), std::ios::binary) << prompt;
  const std::string base = "generate --model " + model().string() + " --max-tokens 6 --json ";
  const Result from_file = run_cli(base + "--prompt-file " + path("prompt.txt").string());
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  const Result from_stdin = run_cli(base + "--prompt-file -", &prompt);
  ASSERT_EQ(from_stdin.exit_code, 0) << from_stdin.err;
  const Result from_flag = run_cli(base + "--prompt \"$(cat " + path("prompt.txt").string() + ")\"");
  ASSERT_EQ(from_flag.exit_code, 0) << from_flag.err;
  const auto a = nlohmann::json::parse(from_file.out), b = nlohmann::json::parse(from_stdin.out),
             c = nlohmann::json::parse(from_flag.out);
  EXPECT_EQ(a["prompt"], prompt);
  EXPECT_EQ(a["generated_ids"], c["generated_ids"]);
  EXPECT_EQ(b["generated_ids"], c["generated_ids"]);
  EXPECT_EQ(a["prompt_tokens"], c["prompt_tokens"]);

  expect_one_line_error(run_cli(base + "--prompt-file " + path("missing.txt").string()), "missing.txt", "missing file");
  expect_one_line_error(run_cli(base + "--prompt x --prompt-file " + path("prompt.txt").string()), "--prompt",
                        "both flags");
  expect_one_line_error(run_cli(base), "--prompt", "no prompt");
}

// Item 10: `eval --methods ,` evaluated nothing with rc 0; `--json /nonexistent/x` failed only
// after the whole evaluation; a --plot that could not be drawn exited 0.
TEST_F(CliHostile, EvalRefusesEmptyMethodListsAndUnwritableOutputsUpFront) {
  const fs::path dir = path("eval_model");  // eval needs a context of 128 at least
  ASSERT_EQ(run_cli("random-model --out " + dir.string() +
                    " --hidden 32 --intermediate 64 --layers 2 --heads 2 --kv-heads 1 --head-dim 16 --max-positions 256")
                .exit_code,
            0);
  {
    std::ofstream text(path("text.txt"));
    for (int i = 0; i < 20; ++i) text << "Some held-out text for the evaluation, written out at some length. ";
  }
  const std::string base = "eval --model " + dir.string() + " --text " + path("text.txt").string() +
                           " --no-progress --levels 0.5 --tasks '' --windows 1 --threads 1 ";
  expect_one_line_error(run_cli(base + "--methods ,"), "names no method", "--methods ,");
  expect_one_line_error(run_cli(base + "--methods ' , '"), "names no method", "--methods ' , '");
  expect_one_line_error(run_cli(base + "--json /nonexistent/x.json"), "/nonexistent", "--json /nonexistent/x.json");
  expect_one_line_error(run_cli(base + "--plot /nonexistent/x.png"), "/nonexistent", "--plot /nonexistent/x.png");
  expect_one_line_error(run_cli(base + "--json " + root_->string()), "is a directory", "--json DIR");
  // The evaluation runs (a second), then the plot fails: no gnuplot on this PATH.
  const Result r = run_cli(base + "--methods h2o --plot " + path("x.png").string(), nullptr, "PATH=/nonexistent");
  expect_one_line_error(r, "--plot", "--plot without gnuplot");
  EXPECT_NE(r.out.find("h2o"), std::string::npos) << "the table is still printed\n" << r.out;
}

// CLI11's own parse errors are one line too, naming the flag.
TEST_F(CliHostile, ParseErrorsAreOneLine) {
  expect_one_line_error(run_cli("generate --prompt hi"), "--model", "missing --model");
  expect_one_line_error(run_cli("generate --model x --prompt hi --max-tokens many"), "--max-tokens", "--max-tokens many");
}

}  // namespace
