#include "engine/eval/report.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "engine/eval/progress.h"
#include "eval_test_util.h"

namespace kvslim::engine::eval {
namespace {

using testing::byte_encode;
using testing::kBos;

// One tiny end-to-end run, shared by the tests below.
const EvalResults& tiny_run() {
  static const EvalResults results = [] {
    static const EpisodeMaker maker(byte_encode, kBos, testing::filler_lines());
    EvalInputs in;
    in.model_dir = "random";
    in.text_source = "synthetic";
    for (int i = 0; i < 600; ++i) in.text_tokens.push_back((i * 31 + 7) % 250);
    in.bos = kBos;
    in.episodes = &maker;
    EvalOptions o = EvalOptions::for_preset("quick");
    o.methods = "h2o,h2o_attn_norm,kivi2";
    o.levels = {0.5};
    o.text_contexts = {48, 96};
    o.continuation = 6;
    o.windows = 1;
    o.tasks = {"passkey"};
    o.retrieval_lengths = {400};
    o.depths = {0.5};
    o.speed_context = 64;
    o.speed_tokens = 3;
    o.threads = 2;
    o.progress = false;
    o.min_full_accuracy = 0.0;
    return run_eval(testing::small_model(), in, o);
  }();
  return results;
}

TEST(EvalReport, JsonHasTheDocumentedKeys) {
  const nlohmann::json j = to_json(tiny_run());
  for (const char* key : {"schema", "preset", "model", "protocol", "full", "points", "speed", "peak_rss_bytes", "elapsed_s"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["schema"], "kvslim-eval/1");
  for (const char* key : {"layers", "kv_heads", "head_dim", "parameters"}) EXPECT_TRUE(j["model"].contains(key)) << key;
  for (const char* key : {"levels", "text", "retrieval", "speed"}) EXPECT_TRUE(j["protocol"].contains(key)) << key;
  ASSERT_EQ(j["full"]["text"].size(), 2u);
  EXPECT_TRUE(j["full"]["text"][0].contains("ppl"));
  ASSERT_EQ(j["points"].size(), 3u);  // h2o @0.5, h2o_attn_norm @0.5, kivi2
  for (const auto& p : j["points"]) {
    for (const char* key : {"variant", "method", "level_target", "config", "text", "retrieval", "compares_to"}) {
      EXPECT_TRUE(p.contains(key)) << key;
    }
    EXPECT_FALSE(p.contains("error")) << p["error"];
    ASSERT_EQ(p["text"].size(), 2u);
    for (const char* key : {"context", "budget", "level", "retained_level", "bytes_per_token", "ppl", "ppl_full", "delta_ppl",
                            "kl", "top1", "kl_ci95", "top1_ci95", "delta_ppl_ci95", "source"}) {
      EXPECT_TRUE(p["text"][0].contains(key)) << key;
    }
    // min_full_accuracy 0 reports the task even for a random model, so the methods run it.
    ASSERT_EQ(p["retrieval"].size(), 1u);
    for (const char* key : {"task", "accuracy", "accuracy_ci95", "full_accuracy", "reported", "cells", "correct", "total"}) {
      EXPECT_TRUE(p["retrieval"][0].contains(key)) << key;
    }
    EXPECT_EQ(p["retrieval"][0]["total"], 1);
  }
  ASSERT_EQ(j["full"]["retrieval"].size(), 1u);
  EXPECT_TRUE(j["full"]["retrieval"][0]["reported"].get<bool>());
  EXPECT_EQ(j["points"][1]["compares_to"], "h2o_original");
  EXPECT_TRUE(j["points"][2]["level_target"].is_null());  // kivi sits at its own bytes
  ASSERT_EQ(j["speed"]["rows"].size(), 4u);              // full + 3 variants
  EXPECT_EQ(j["speed"]["rows"][0]["variant"], "full");
  for (const char* key : {"tokens_per_s", "ratio", "bytes_per_token", "resident_bytes"}) {
    EXPECT_TRUE(j["speed"]["rows"][1].contains(key)) << key;
  }
  EXPECT_GT(j["peak_rss_bytes"].get<double>(), 0);
}

TEST(EvalReport, LevelsAreMeasuredNotNominal) {
  const EvalResults& r = tiny_run();
  const PointResult& h2o = r.points[0];
  ASSERT_TRUE(h2o.error.empty()) << h2o.error;
  for (const auto& t : h2o.text) {
    EXPECT_NEAR(t.retained_level, 0.5, 0.05) << "context " << t.context;
    EXPECT_NEAR(t.totals.level(), 0.5, 0.05);
    EXPECT_GT(t.budget, 0);
  }
  const PointResult& kivi = r.points[2];
  ASSERT_TRUE(kivi.error.empty()) << kivi.error;
  EXPECT_EQ(kivi.text[0].budget, 0);
  EXPECT_GT(kivi.text[0].totals.level(), 0.0);
}

TEST(EvalReport, TableNamesEveryVariant) {
  char* buf = nullptr;
  std::size_t size = 0;
  std::FILE* f = open_memstream(&buf, &size);
  print_table(f, tiny_run());
  std::fclose(f);
  const std::string table(buf, size);
  std::free(buf);
  for (const char* name : {"full", "h2o", "h2o_attn_norm", "kivi2", "decode speed", "peak RSS"}) {
    EXPECT_NE(table.find(name), std::string::npos) << name;
  }
}

TEST(EvalReport, JsonFileIsWrittenAndUnwritablePathsThrow) {
  const auto path = std::filesystem::temp_directory_path() / ("kvslim_eval_" + std::to_string(getpid()) + ".json");
  write_json(path, tiny_run());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["schema"], "kvslim-eval/1");
  std::filesystem::remove(path);
  EXPECT_THROW(write_json("/nonexistent-dir/x.json", tiny_run()), std::runtime_error);
}

TEST(EvalProgress, DurationsAndTimeLeft) {
  EXPECT_EQ(ProgressBar::format_duration(42.4), "42s");
  EXPECT_EQ(ProgressBar::format_duration(65), "1m05s");
  EXPECT_EQ(ProgressBar::format_duration(3720), "1h02m");
  EXPECT_LT(ProgressBar::eta_seconds(0, 10, 5), 0);
  EXPECT_DOUBLE_EQ(ProgressBar::eta_seconds(2, 10, 4), 16.0);
  char* buf = nullptr;
  std::size_t size = 0;
  std::FILE* f = open_memstream(&buf, &size);
  {
    ProgressBar bar("test", 4, true, f, 0.0);
    bar.advance(1, "first");
    bar.advance(10);  // clamped to the total
    EXPECT_DOUBLE_EQ(bar.done(), 4.0);
  }
  std::fclose(f);
  const std::string out(buf, size);
  std::free(buf);
  EXPECT_NE(out.find("test ["), std::string::npos);
  EXPECT_NE(out.find("done in"), std::string::npos);
}

}  // namespace
}  // namespace kvslim::engine::eval
