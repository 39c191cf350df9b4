// llama-perplexity's logits file (engine/eval/kld_file.h): written, read back, and its KL
// statistics against a direct double-precision computation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "engine/eval/kld_file.h"
#include "loader_test_util.h"

namespace kvslim::engine::eval {
namespace {

// log-softmax in double.
std::vector<double> log_softmax(const float* l, std::size_t n) {
  double m = l[0];
  for (std::size_t i = 1; i < n; ++i) m = std::max(m, static_cast<double>(l[i]));
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += std::exp(l[i] - m);
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = l[i] - m - std::log(s);
  return out;
}

TEST(KldFile, RoundTripAndStatisticsMatchADirectComputation) {
  testing::TempDir tmp;
  KldHeader h;
  h.n_ctx = 8;  // rows: positions 4..6 -> 3 per chunk
  h.n_vocab = 5;
  h.n_chunk = 2;
  for (int i = 0; i < 16; ++i) h.tokens.push_back(i % 5);
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 2.0f);
  std::vector<float> base(2 * 3 * 5), run(base.size());
  for (std::size_t i = 0; i < base.size(); ++i) {
    base[i] = g(rng);
    run[i] = base[i] + 0.3f * g(rng);
  }
  {
    KldWriter w(tmp / "b.kld", h);
    w.add_chunk(std::span<const float>(base).first(15));
    w.add_chunk(std::span<const float>(base).subspan(15));
    w.finish();
  }
  {  // Issue 26: an unfinished writer (an error mid-run) leaves no file, and no temporary beside it.
    KldWriter w(tmp / "unfinished.kld", h);
    w.add_chunk(std::span<const float>(base).first(15));
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "unfinished.kld"));
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find("kvslim-tmp"), std::string::npos) << e.path();
  }
  KldReader r(tmp / "b.kld");
  EXPECT_EQ(r.header().n_ctx, 8u);
  EXPECT_EQ(r.header().tokens, h.tokens);
  EXPECT_EQ(r.header().row_u16(), 2u * 3 + 4);
  KldStats self, other;
  double kl = 0, nll = 0;
  std::size_t same = 0;
  for (int c = 0; c < 2; ++c) {
    const auto& rows = r.next_chunk();
    for (int k = 0; k < 3; ++k) {
      const float* b = base.data() + (c * 3 + k) * 5;
      const float* m = run.data() + (c * 3 + k) * 5;
      const int token = h.tokens[c * 8 + 4 + k + 1];
      self.add(std::span<const float>(b, 5), rows.data() + k * r.header().row_u16(), token);
      other.add(std::span<const float>(m, 5), rows.data() + k * r.header().row_u16(), token);
      const auto lb = log_softmax(b, 5), lm = log_softmax(m, 5);
      for (int i = 0; i < 5; ++i) kl += std::exp(lb[i]) * (lb[i] - lm[i]);
      nll -= lm[token];
      same += std::max_element(b, b + 5) - b == std::max_element(m, m + 5) - m;
    }
  }
  EXPECT_EQ(self.count, 6u);
  EXPECT_LT(std::abs(self.mean_kld()), 1e-5);  // u16 codes over a 16-nat range: ~2.4e-4 nats per step
  EXPECT_EQ(self.same_top, 6u);
  EXPECT_NEAR(other.mean_kld(), kl / 6, 2e-4);
  EXPECT_NEAR(other.mean_nll(), nll / 6, 1e-5);
  EXPECT_NEAR(other.mean_nll_base(), self.mean_nll(), 1e-3);
  EXPECT_EQ(other.same_top, same);
  EXPECT_THROW(r.next_chunk(), std::runtime_error);  // past the last chunk
}

TEST(KldFile, RejectsOtherFiles) {
  testing::TempDir tmp;
  testing::write_file(tmp / "x", "not a logits file at all");
  EXPECT_THROW(KldReader(tmp / "x"), std::runtime_error);
  // A header announcing 2^24-token chunks of a 2^24-token vocabulary: refused before allocating.
  std::string huge = "_logits_";
  for (std::uint32_t v : {1u << 24, 1u << 24, 1u}) huge.append(reinterpret_cast<const char*>(&v), 4);
  testing::write_file(tmp / "huge", huge);
  try {
    KldReader r(tmp / "huge");
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("implausible sizes"), std::string::npos) << e.what();
  }
  // Issue 26: a plausible header on a short file is refused before its token list is allocated;
  // a directory is named as one.
  std::string claims = "_logits_";
  for (std::uint32_t v : {1u << 16, 1000u, 1000u}) claims.append(reinterpret_cast<const char*>(&v), 4);
  testing::write_file(tmp / "short", claims);
  try {
    KldReader r(tmp / "short");
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated (its header claims"), std::string::npos) << e.what();
  }
  try {
    KldReader r(tmp.path());
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvslim::engine::eval
