// The CLI reproductions of issue 26 ("hostile and careless input, round 2"), each as the user ran
// it: nothing from the user runs as code, no output is written over an input or left half-written,
// no parallel phase aborts, every reader is bounded, and every numeric flag has a range and a
// message naming it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;
using kvslim::cli_testing::Result;
using kvslim::cli_testing::run_cli;

void expect_one_line_error(const Result& r, const std::string& fragment, const std::string& what) {
  EXPECT_NE(r.exit_code, -1) << what << ": killed by a signal\n" << r.err;
  EXPECT_NE(r.exit_code, 0) << what;
  EXPECT_EQ(r.err.rfind("kvslim: error: ", 0), 0u) << what << "\n" << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << "\n" << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << what << ": '" << fragment << "' not in\n" << r.err;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A single-quoted shell word (paths below hold apostrophes on purpose).
std::string sh(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// No file whose name holds "kvslim-tmp" is left in `dir` (the atomic writers' temporaries).
void expect_no_temporaries(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().find("kvslim-tmp"), std::string::npos) << "left behind: " << e.path();
  }
}

class CliCareless : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() / ("kvslim_cli_careless_" + std::to_string(getpid())));
    fs::create_directories(*root_);
    // 256 positions: enough for eval's quick preset (128 at least), small enough to run in a second.
    const Result r = run_cli("random-model --out " + model().string() +
                             " --hidden 32 --intermediate 64 --layers 2 --heads 2 --kv-heads 1 --head-dim 16"
                             " --max-positions 256 --dtype f32");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::ofstream text(path("text.txt"));
    for (int i = 0; i < 20; ++i) text << "Some held-out text for the evaluation, written out at some length. ";
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path model() { return *root_ / "model"; }
  static fs::path path(const std::string& name) { return *root_ / name; }
  static std::string eval_base(const fs::path& model_dir, const std::string& text = "") {
    return "eval --model " + sh(model_dir.string()) + " --text " + (text.empty() ? path("text.txt").string() : text) +
           " --no-progress --levels 0.5 --tasks '' --windows 1 --no-speed --methods h2o ";
  }
  static fs::path* root_;
};
fs::path* CliCareless::root_ = nullptr;

// Item 1: the model path and the plot path reached gnuplot's script as code.
TEST_F(CliCareless, EvalPlotRunsNothingFromPathsAndPlotsAnyPath) {
  const fs::path work = path("plot_work");
  fs::create_directories(work);
  const fs::path evil = work / "q'.system('touch PWNED').'";
  fs::copy(model(), evil);
  const fs::path png = work / "John's plot `touch PWNED2`.png";
  const Result r = run_cli(eval_base(evil) + "--threads 1 --plot " + sh(png.string()), nullptr, "cd " + sh(work.string()) + " &&");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(work / "PWNED")) << "the model path ran as gnuplot code";
  EXPECT_FALSE(fs::exists(work / "PWNED2")) << "the plot path ran as gnuplot code";
  ASSERT_TRUE(fs::exists(png));
  EXPECT_GT(fs::file_size(png), 1000u);
  EXPECT_EQ(slurp(png).substr(1, 3), "PNG");
  expect_no_temporaries(work);
}

// Item 2: outputs over inputs.
TEST_F(CliCareless, ConvertRefusesToWriteOverTheModelItReads) {
  const std::string before = slurp(model() / "model.safetensors");
  const Result r = run_cli("convert " + model().string() + " " + (model() / "model.safetensors").string());
  expect_one_line_error(r, "is an input", "convert m m/model.safetensors");
  EXPECT_EQ(slurp(model() / "model.safetensors"), before);
  // A GGUF converted into the model directory is an output, not an input: converting again replaces it.
  ASSERT_EQ(run_cli("convert " + model().string() + " " + (model() / "model.gguf").string()).exit_code, 0);
  EXPECT_EQ(run_cli("convert " + model().string() + " " + (model() / "model.gguf").string()).exit_code, 0);
  fs::remove(model() / "model.gguf");
  // Through a symlink too.
  fs::create_symlink(model() / "config.json", path("link.gguf"));
  expect_one_line_error(run_cli("convert " + model().string() + " " + path("link.gguf").string()), "is an input", "symlink");
}

TEST_F(CliCareless, RandomModelRefusesANonEmptyDirectoryWithoutForce) {
  const fs::path dir = path("rm_target");
  ASSERT_EQ(run_cli("random-model --out " + dir.string() + " --layers 1 --hidden 16 --intermediate 32 --heads 1 --kv-heads 1").exit_code, 0);
  std::ofstream(dir / "model-00001-of-00002.safetensors") << "another model's shard";
  const std::string before = slurp(dir / "model.safetensors");
  expect_one_line_error(run_cli("random-model --out " + dir.string() + " --layers 2 --seed 9"), "--force", "non-empty --out");
  EXPECT_EQ(slurp(dir / "model.safetensors"), before);
  // --force replaces the model, and leaves no file of the previous one (no mixed directory).
  const Result r = run_cli("random-model --out " + dir.string() + " --layers 2 --seed 9 --force");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  EXPECT_NE(slurp(dir / "model.safetensors"), before);
  EXPECT_EQ(run_cli("info --model " + dir.string()).exit_code, 0);
  expect_one_line_error(run_cli("random-model --out " + (dir / "config.json").string()), "not a directory", "--out FILE");
  expect_no_temporaries(*root_);
}

TEST_F(CliCareless, BenchKldRefusesAWriteBaseOverItsReference) {
  const fs::path base = path("base.kld");
  Result r = run_cli("bench kld --model " + model().string() + " --text " + path("text.txt").string() +
                     " --ctx 16 --chunks 2 --write-base " + base.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string before = slurp(base);
  ASSERT_GT(before.size(), 100u);
  r = run_cli("bench kld --model " + model().string() + " --ref a=" + base.string() + " --write-base " + base.string());
  expect_one_line_error(r, "--write-base", "--write-base == --ref");
  EXPECT_NE(r.err.find("is an input"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(base), before);
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --ref a=" + base.string() + " --json " + base.string()),
                        "--json", "--json == --ref");
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --ref a=" + base.string() + " --json " +
                                path("same.out").string() + " --write-base " + path("same.out").string()),
                        "the same file", "--json == --write-base");
  EXPECT_EQ(slurp(base), before);
}

TEST_F(CliCareless, EvalRefusesAJsonOverItsText) {
  expect_one_line_error(run_cli(eval_base(model()) + "--json " + path("text.txt").string()), "is an input", "--json == --text");
  expect_one_line_error(run_cli(eval_base(model()) + "--plot " + (model() / "config.json").string()), "is an input",
                        "--plot over the model");
}

// Item 3: a failed write (here: the file-size limit, as a full disk) leaves the previous file
// whole and no temporary behind.
TEST_F(CliCareless, FailedWritesLeaveThePreviousFileIntact) {
  const fs::path dir = path("atomic");
  fs::create_directories(dir);
  const fs::path out = dir / "out.gguf";
  std::ofstream(out) << "the previous file";
  // SIGXFSZ ignored: writes past the limit fail with EFBIG instead of killing the process.
  const std::string limit = "trap '' XFSZ; ulimit -f 8;";  // 4 KiB
  Result r = run_cli("convert " + model().string() + " " + out.string() + " --type f32", nullptr, limit);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, -1) << r.err;
  EXPECT_EQ(slurp(out), "the previous file");
  expect_no_temporaries(dir);
  r = run_cli("random-model --out " + (dir / "new_model").string(), nullptr, limit);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(fs::exists(dir / "new_model")) << "a half-written model directory";
  expect_no_temporaries(dir);
  // And without the limit both succeed.
  r = run_cli("convert " + model().string() + " " + out.string() + " --type f32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(slurp(out).substr(0, 4), "GGUF");
  expect_no_temporaries(dir);
}

// Item 4: a failure inside eval's parallel phases aborted the process at --threads >= 2.
TEST_F(CliCareless, EvalChecksContextsUpFrontAtAnyThreadCount) {
  for (const std::string threads : {"1", "2", "4"}) {
    const Result r = run_cli(eval_base(model()) + "--threads " + threads + " --contexts 5000");
    expect_one_line_error(r, "--contexts 5000", "--contexts 5000 --threads " + threads);
    EXPECT_NE(r.err.find("max_position_embeddings = 256"), std::string::npos) << r.err;
  }
  expect_one_line_error(run_cli(eval_base(model()) + "--threads 2 --tasks passkey --lengths 300"), "--lengths 300", "--lengths");
}

TEST_F(CliCareless, EvalJsonTakesANonUtf8Path) {
  const fs::path odd = path(std::string("model_\xff\xfe"));
  fs::copy(model(), odd);
  const fs::path json = path("odd.json");
  const Result r = run_cli(eval_base(odd) + "--threads 2 --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(slurp(json));
  EXPECT_NE(doc.dump().find("model_"), std::string::npos);
  EXPECT_FALSE(fs::exists(json.string() + ".partial"));
}

// Item 7: unbounded reads, directories as text files, FIFOs that end.
TEST_F(CliCareless, TextInputsAreBoundedAndNamed) {
  const std::string gen = "generate --model " + model().string() + " --max-tokens 1 ";
  expect_one_line_error(run_cli(gen + "--prompt-file /dev/zero"), "--prompt-file /dev/zero: more than", "/dev/zero");
  expect_one_line_error(run_cli(gen + "--prompt-file -", nullptr, "yes |"), "--prompt-file -: more than", "endless stdin");
  expect_one_line_error(run_cli(gen + "--prompt-file " + root_->string()), "is a directory", "--prompt-file DIR");
  expect_one_line_error(run_cli(eval_base(model(), "/dev/zero")), "--text /dev/zero: more than", "eval --text /dev/zero");
  expect_one_line_error(run_cli(eval_base(model(), root_->string())), "is a directory", "eval --text DIR");
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --text /dev/zero --write-base " + path("z.kld").string()),
                        "--text /dev/zero: more than", "bench kld --text /dev/zero");
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --text " + root_->string() + " --write-base " +
                                path("z.kld").string()),
                        "is a directory", "bench kld --text DIR");
  EXPECT_FALSE(fs::exists(path("z.kld")));
  // A FIFO whose writer ends is read to its end.
  const fs::path fifo = path("prompt.fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const Result r = run_cli(gen + "--prompt-file " + fifo.string(), nullptr, "(printf 'hello there' > " + fifo.string() + " &);");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// Item 9: --seed past 2^64 - 1 was clamped without a word (every unsigned flag).
TEST_F(CliCareless, UnsignedFlagsRefuseValuesPastTheirType) {
  expect_one_line_error(run_cli("random-model --out " + path("big_seed").string() + " --seed 18446744073709551616"), "--seed",
                        "--seed 2^64");
  expect_one_line_error(run_cli("generate --model " + model().string() + " --prompt hi --seed 99999999999999999999999"),
                        "--seed", "generate --seed");
  EXPECT_FALSE(fs::exists(path("big_seed")));
  EXPECT_EQ(run_cli("random-model --out " + path("max_seed").string() + " --seed 18446744073709551615").exit_code, 0);
}

// Item 10: bench engine measured the first context, then refused the second and lost the --json.
TEST_F(CliCareless, BenchEngineChecksEveryContextFirst) {
  const Result r = run_cli("bench engine --model " + model().string() + " --context 16 --context 8192 --decode-tokens 2 --repeats 1 --json " +
                           path("engine.json").string());
  expect_one_line_error(r, "--context 8192", "--context 16 --context 8192");
  EXPECT_EQ(r.out.find("gemv"), std::string::npos) << "work started before the check\n" << r.out;
}

// Item 11: crashes and unclear messages of the small commands.
TEST_F(CliCareless, SmallCommandsNameTheFlag) {
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --text " + path("text.txt").string() +
                                " --ctx 0 --write-base " + path("c.kld").string()),
                        "--ctx", "bench kld --ctx 0");
  expect_one_line_error(run_cli("bench kld --model " + model().string() + " --text " + path("text.txt").string() +
                                " --chunks 0 --write-base " + path("c.kld").string()),
                        "--chunks", "bench kld --chunks 0");
  for (const std::string& args : {std::string("--layers 0"), std::string("--layers=-3"), std::string("--seq=-5"),
                                  std::string("--avg 0"), std::string("--strength 2")}) {
    expect_one_line_error(run_cli("bench squeeze --repeats 1 " + args), args.substr(0, args.find_first_of(" =")), args);
  }
  expect_one_line_error(run_cli("bench squeeze --repeats 1 --seq 8 --avg 64"), "--seq", "--seq below every --avg");
  const Result info = run_cli("info --model " + (model() / "model.safetensors").string());
  expect_one_line_error(info, "pass its directory", "info --model FILE.safetensors");
  EXPECT_EQ(info.err.find("Not a directory"), std::string::npos) << info.err;
  expect_one_line_error(run_cli("info --model " + path("nothing_here").string()), "no such model", "info --model MISSING");
  expect_one_line_error(run_cli("bench attend --cache bogus --repeats 1"), "bogus", "bench attend --cache bogus");
  expect_one_line_error(run_cli("bench attend --device cuda --eager-stream side"), "--eager-stream",
                        "bench attend --eager-stream side");
  for (const std::string& args : {std::string("--top-p 0"), std::string("--temperature nan"), std::string("--top-k=-1"),
                                  std::string("--prefill-chunk 99999999999")}) {
    expect_one_line_error(run_cli("generate --model " + model().string() + " --prompt hi " + args), args.substr(0, args.find_first_of(" =")),
                          "generate " + args);
  }
  for (const std::string& args : {std::string("--contexts 4"), std::string("--depths 2"), std::string("--levels 0"),
                                  std::string("--lengths 3"), std::string("--windows 99999999")}) {
    expect_one_line_error(run_cli(eval_base(model()) + args), args.substr(0, args.find(' ')), "eval " + args);
  }
}

// `eval --dump-episodes`: the retrieval episodes the run would score, one JSON line each, the same
// on every call with the same seed (another engine replays them: bench/cuda/hf_retrieval.py), and
// a clear error when the run has no retrieval task.
TEST_F(CliCareless, EvalDumpsTheEpisodesItWouldScore) {
  const std::string base = "eval --model " + sh(model().string()) + " --text " + path("text.txt").string() +
                           " --no-progress --lengths 250 --depths 0.25,0.75 --trials 1 ";
  const fs::path a = path("episodes_a.jsonl"), b = path("episodes_b.jsonl");
  Result r = run_cli(base + "--tasks passkey,kvlist --dump-episodes " + sh(a.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_cli(base + "--tasks passkey,kvlist --dump-episodes " + sh(b.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string text = slurp(a);
  EXPECT_EQ(text, slurp(b));
  std::size_t lines = 0, passkey = 0, kvlist = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    ++lines;
    passkey += line.find("\"task\":\"passkey\"") != std::string::npos;
    kvlist += line.find("\"task\":\"kvlist\"") != std::string::npos;
    for (const char* field : {"\"prompt\":[", "\"question_start\":", "\"answer\":[", "\"answer_text\":\"", "\"follow_ups\":["}) {
      EXPECT_NE(line.find(field), std::string::npos) << field << " in " << line.substr(0, 200);
    }
  }
  EXPECT_EQ(lines, 4u);  // 2 tasks x 2 depths x 1 trial
  EXPECT_EQ(passkey, 2u);
  EXPECT_EQ(kvlist, 2u);
  r = run_cli(base + "--tasks '' --dump-episodes " + sh(path("none.jsonl").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--dump-episodes"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("none.jsonl")));
}

}  // namespace
