// Kernels of the forward pass against direct formulas: gemv per weight type and target (odd sizes,
// tails), matmul, RMSNorm, softmax, SwiGLU, RoPE (plain, linear, llama3) and the thread pool.
#include "engine/ops.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <cmath>
#include <numbers>
#include <vector>

#include "engine/sampler.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {
namespace {

struct StoredMatrix {
  std::vector<std::uint8_t> bytes;
  std::vector<double> exact;  // the stored values as doubles, [rows, cols]
  Matrix m;
};

StoredMatrix random_matrix(WeightType type, std::size_t rows, std::size_t cols, std::uint64_t seed) {
  Rng rng(seed);
  StoredMatrix s;
  const std::size_t es = type == WeightType::f32 ? 4 : 2;
  s.bytes.resize(rows * cols * es);
  s.exact.resize(rows * cols);
  for (std::size_t i = 0; i < rows * cols; ++i) {
    const float v = 2.0f * rng.uniform() - 1.0f;
    if (type == WeightType::f32) {
      std::memcpy(s.bytes.data() + 4 * i, &v, 4);
      s.exact[i] = v;
    } else {
      const std::uint16_t h = type == WeightType::f16 ? f32_to_fp16(v) : f32_to_bf16(v);
      std::memcpy(s.bytes.data() + 2 * i, &h, 2);
      s.exact[i] = type == WeightType::f16 ? fp16_to_f32(h) : bf16_to_f32(h);
    }
  }
  s.m = Matrix{type, s.bytes.data(), rows, cols};
  return s;
}

std::vector<float> random_vector(std::size_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = 2.0f * rng.uniform() - 1.0f;
  return v;
}

class GemvTest : public ::testing::TestWithParam<std::tuple<WeightType, std::string>> {
 protected:
  void TearDown() override { gemv_force_target(""); }
};

TEST_P(GemvTest, MatchesNaiveDotProductsAtOddSizes) {
  const auto [type, target] = GetParam();
  try {
    gemv_force_target(target);
  } catch (const std::invalid_argument&) {
    GTEST_SKIP() << target << " not supported on this CPU";
  }
  ThreadPool pool(2);
  // Sizes cover: shorter than one vector, tails after 16/32-wide blocks, and a matrix big enough
  // to be split over the pool's threads.
  for (auto [rows, cols] : {std::pair<std::size_t, std::size_t>{1, 1}, {3, 7}, {5, 33}, {17, 100}, {129, 257},
                            {700, 513}}) {
    const StoredMatrix w = random_matrix(type, rows, cols, rows * 131 + cols);
    const std::vector<float> x = random_vector(cols, cols);
    std::vector<float> y(rows, NAN);
    gemv(w.m, x.data(), y.data(), &pool);
    for (std::size_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (std::size_t c = 0; c < cols; ++c) {
        ref += w.exact[r * cols + c] * x[c];
        mag += std::abs(w.exact[r * cols + c] * x[c]);
      }
      // fp32 accumulation of `cols` products: error grows like eps * sum|terms|.
      ASSERT_NEAR(y[r], ref, 1e-6 * mag + 1e-6) << rows << "x" << cols << " row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypesAndTargets, GemvTest,
                         ::testing::Combine(::testing::Values(WeightType::f32, WeightType::f16, WeightType::bf16),
                                            ::testing::Values("scalar", "avx2", "avx512")));

TEST(Gemv, TargetNameIsKnownAndBadTargetThrows) {
  const std::string name = gemv_target_name();
  EXPECT_TRUE(name == "scalar" || name == "avx2" || name == "avx512") << name;
  EXPECT_THROW(gemv_force_target("neon"), std::invalid_argument);
}

TEST(Matmul, MatchesGemvPerRowForEveryType) {
  for (WeightType type : {WeightType::f32, WeightType::f16, WeightType::bf16}) {
    const std::size_t rows = 300, cols = 37, n = 5;  // 300 rows: two 256-row tiles, one partial
    const StoredMatrix w = random_matrix(type, rows, cols, 9);
    const std::vector<float> x = random_vector(n * cols, 3);
    std::vector<float> tile(256 * cols), y(n * rows), ref(rows);
    matmul(w.m, x.data(), n, y.data(), tile.data(), 256);
    for (std::size_t s = 0; s < n; ++s) {
      gemv(w.m, x.data() + s * cols, ref.data());
      for (std::size_t r = 0; r < rows; ++r) ASSERT_NEAR(y[s * rows + r], ref[r], 1e-5) << s << "," << r;
    }
  }
}

TEST(Rmsnorm, MatchesFormula) {
  const std::vector<float> x = {1, -2, 3, 0.5f, -0.25f};
  const std::vector<float> w = {1, 2, 0.5f, 1, -1};
  std::vector<float> out(5);
  rmsnorm(out.data(), x.data(), w.data(), 5, 1e-5f);
  double ms = 0;
  for (float v : x) ms += v * v;
  const double inv = 1.0 / std::sqrt(ms / 5 + 1e-5);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(out[i], x[i] * inv * w[i], 1e-6);
}

TEST(Softmax, SumsToOneAndZeroesMaskedEntries) {
  std::vector<float> v = {1000.0f, -INFINITY, 1001.0f, 999.0f};  // large values: needs max-subtraction
  softmax(v.data(), v.size());
  EXPECT_EQ(v[1], 0.0f);
  EXPECT_NEAR(v[0] + v[2] + v[3], 1.0f, 1e-6);
  EXPECT_NEAR(v[2] / v[0], std::exp(1.0), 1e-4);
}

TEST(Swiglu, IsSiluOfGateTimesUp) {
  std::vector<float> gate = {-3, 0, 0.5f, 4}, up = {2, 5, -1, 0.25f};
  const std::vector<float> g0 = gate;
  swiglu(gate.data(), up.data(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(gate[i], g0[i] / (1 + std::exp(-g0[i])) * up[i], 1e-6);
}

TEST(Rope, DefaultFrequenciesAndRotateHalfLayout) {
  const int d = 8;
  RopeTable rope(d, 10000.0, RopeScaling{});
  std::vector<float> c(d / 2), s(d / 2);
  const std::int64_t pos = 37;
  rope.angles(pos, c.data(), s.data());
  std::vector<float> x = random_vector(d, 5), y = x;
  rope_rotate(y.data(), c.data(), s.data(), d);
  for (int i = 0; i < d / 2; ++i) {
    const double theta = pos * std::pow(10000.0, -2.0 * i / d);
    EXPECT_NEAR(y[i], x[i] * std::cos(theta) - x[i + d / 2] * std::sin(theta), 1e-5);
    EXPECT_NEAR(y[i + d / 2], x[i + d / 2] * std::cos(theta) + x[i] * std::sin(theta), 1e-5);
  }
}

TEST(Rope, RotationPreservesNormAndRelativePositionDot) {
  // <R(p)q, R(p')k> depends on p - p' only: the property attention relies on.
  const int d = 16;
  RopeTable rope(d, 500000.0, RopeScaling{});
  const std::vector<float> q = random_vector(d, 1), k = random_vector(d, 2);
  auto rotated = [&](std::vector<float> v, std::int64_t p) {
    std::vector<float> c(d / 2), s(d / 2);
    rope.angles(p, c.data(), s.data());
    rope_rotate(v.data(), c.data(), s.data(), d);
    return v;
  };
  auto dot = [](const std::vector<float>& a, const std::vector<float>& b) {
    double r = 0;
    for (std::size_t i = 0; i < a.size(); ++i) r += a[i] * b[i];
    return r;
  };
  EXPECT_NEAR(dot(rotated(q, 10), rotated(k, 3)), dot(rotated(q, 107), rotated(k, 100)), 1e-4);
  EXPECT_NEAR(dot(rotated(q, 1234), rotated(q, 1234)), dot(q, q), 1e-4);
}

TEST(Rope, Llama3ScalingMatchesHfFormula) {
  RopeScaling sc;
  sc.type = "llama3";
  sc.factor = 8;
  sc.low_freq_factor = 1;
  sc.high_freq_factor = 4;
  sc.original_max_position_embeddings = 64;  // small, so low, medium and high bands all occur
  const int d = 32;
  const double theta = 10000;
  RopeTable rope(d, theta, sc);
  int low = 0, mid = 0, high = 0;
  for (int i = 0; i < d / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / d);
    const double wavelen = 2 * std::numbers::pi / f;
    double expected;
    if (wavelen < 64.0 / 4) {
      expected = f, ++high;
    } else if (wavelen > 64.0 / 1) {
      expected = f / 8, ++low;
    } else {
      const double smooth = (64.0 / wavelen - 1) / (4 - 1);
      expected = (1 - smooth) * f / 8 + smooth * f, ++mid;
    }
    EXPECT_NEAR(rope.inv_freq()[i], expected, 1e-6 * expected) << i;
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
  EXPECT_GT(high, 0);
}

TEST(Rope, LinearScalingDividesFrequenciesAndUnknownTypeThrows) {
  RopeScaling sc;
  sc.type = "linear";
  sc.factor = 4;
  RopeTable plain(8, 10000, RopeScaling{}), linear(8, 10000, sc);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(linear.inv_freq()[i], plain.inv_freq()[i] / 4);
  sc.type = "yarn";
  EXPECT_THROW(RopeTable(8, 10000, sc), ModelFileError);
  EXPECT_THROW(RopeTable(7, 10000, RopeScaling{}), ModelFileError);
}

TEST(ThreadPool, RunsEveryTaskExactlyOnceAcrossManyCalls) {
  ThreadPool pool(2);
  EXPECT_EQ(pool.threads(), 2);
  std::vector<std::atomic<int>> hits(37);
  for (int round = 0; round < 200; ++round) {
    auto task = [&](int i) { hits[i].fetch_add(1); };
    pool.for_each(37, task);
  }
  for (auto& h : hits) EXPECT_EQ(h.load(), 200);
}

// Issue 26: an exception thrown by a task on a worker thread terminated the process; now it
// reaches run()'s caller once every task has finished, and the pool stays usable.
TEST(ThreadPool, ATaskExceptionReachesTheCallerFromAnyThread) {
  ThreadPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> ran{0};
    const int bad = round % 8;
    auto task = [&](int i) {
      ran.fetch_add(1);
      if (i == bad) throw std::runtime_error("task " + std::to_string(i) + " failed");
    };
    try {
      pool.for_each(8, task);
      ADD_FAILURE() << "expected the task's exception";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "task " + std::to_string(bad) + " failed");
    }
    EXPECT_EQ(ran.load(), 8);  // every task ran: run() returned only after all of them
  }
  std::atomic<int> ok{0};
  auto count = [&](int) { ok.fetch_add(1); };
  pool.for_each(16, count);
  EXPECT_EQ(ok.load(), 16);
}

}  // namespace
}  // namespace kvslim::engine
