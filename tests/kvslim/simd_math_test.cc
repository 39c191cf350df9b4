// The elementwise math kernels the engine's forward pass uses (softmax of prefill scores, the
// SwiGLU of the MLP) and the multi-query dot products of the blocked H2O scorer against
// double-precision references, on every dispatched target.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels.h"
#include "simd_targets.h"

namespace kvslim {
namespace {

using testing::for_each_target;

std::vector<float> uniform(std::size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(SimdMath, SoftmaxMatchesDoubleReferenceAndZeroesMaskedEntries) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for_each_target([&] {
    for (std::size_t n : {1u, 3u, 15u, 16u, 17u, 64u, 1000u, 1027u}) {
      std::vector<float> x = uniform(n, -30.0f, 30.0f, static_cast<unsigned>(n));
      for (std::size_t i = 1; i < n; i += 3) x[i] = ninf;  // masked (future) entries
      double mx = -INFINITY, sum = 0;
      for (float v : x) mx = std::max<double>(mx, v);
      for (float v : x) sum += v == ninf ? 0.0 : std::exp(static_cast<double>(v) - mx);
      std::vector<float> y = x;
      kernels::softmax_inplace(y.data(), n);
      double total = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double want = x[i] == ninf ? 0.0 : std::exp(static_cast<double>(x[i]) - mx) / sum;
        if (x[i] == ninf) {
          EXPECT_EQ(y[i], 0.0f) << "n=" << n << " i=" << i;
        } else {
          EXPECT_NEAR(y[i], want, 2e-6 + 2e-5 * want) << "n=" << n << " i=" << i;
        }
        total += y[i];
      }
      EXPECT_NEAR(total, 1.0, 1e-5) << "n=" << n;
    }
  });
}

// The H2O step: acc += softmax(logits * scale), logits left holding the unnormalised weights; every
// length from 1 to 40 (whole vectors and masked tails) and a long one, every target.
TEST(SimdMath, SoftmaxAccumulateMatchesDoubleReferenceAtEveryLength) {
  for_each_target([&] {
    std::vector<std::size_t> lengths(40);
    for (std::size_t i = 0; i < lengths.size(); ++i) lengths[i] = i + 1;
    lengths.push_back(1031);
    for (std::size_t n : lengths) {
      const std::vector<float> x = uniform(n, -8.0f, 8.0f, static_cast<unsigned>(100 + n));
      std::vector<float> acc = uniform(n, 0.0f, 1.0f, static_cast<unsigned>(200 + n)), logits = x;
      const std::vector<float> acc0 = acc;
      const float scale = 0.35f;
      kernels::softmax_accumulate(logits.data(), n, scale, acc.data());
      double mx = -INFINITY, sum = 0;
      for (float v : x) mx = std::max<double>(mx, v * static_cast<double>(scale));
      for (float v : x) sum += std::exp(v * static_cast<double>(scale) - mx);
      for (std::size_t i = 0; i < n; ++i) {
        const double w = std::exp(x[i] * static_cast<double>(scale) - mx);
        ASSERT_NEAR(logits[i], w, 1e-6 * w + 1e-7) << "n=" << n << " i=" << i;
        ASSERT_NEAR(acc[i], acc0[i] + w / sum, 1e-6) << "n=" << n << " i=" << i;
      }
    }
  });
}

TEST(SimdMath, SwigluMatchesDoubleReferenceIncludingSaturatedGates) {
  for_each_target([&] {
    for (std::size_t n : {1u, 7u, 16u, 33u, 1024u}) {
      std::vector<float> gate = uniform(n, -20.0f, 20.0f, 3 + static_cast<unsigned>(n));
      const std::vector<float> up = uniform(n, -4.0f, 4.0f, 5 + static_cast<unsigned>(n));
      if (n > 4) {  // far outside exp's range: silu saturates to 0 and to g
        gate[0] = -500.0f;
        gate[1] = 500.0f;
        gate[2] = -89.5f;
        gate[3] = 0.0f;
      }
      std::vector<float> got = gate;
      kernels::swiglu_inplace(got.data(), up.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const double g = gate[i];
        const double want = g / (1.0 + std::exp(-g)) * up[i];
        ASSERT_TRUE(std::isfinite(got[i])) << "n=" << n << " gate=" << g;
        EXPECT_NEAR(got[i], want, 1e-5 + 2e-6 * std::fabs(want)) << "n=" << n << " gate=" << g;
      }
    }
  });
}

TEST(SimdMath, DotColumnsMatchesDoubleReferenceForEveryQueryAndColumnCount) {
  for_each_target([&] {
    for (std::size_t d : {1u, 16u, 33u, 128u}) {
      for (std::size_t n : {1u, 5u, 16u, 63u, 64u, 65u, 200u}) {
        for (std::size_t nq : {1u, 3u, 4u, 7u, 64u}) {
          const std::size_t ld = kernels::padded_columns(n) + 3;  // a stride that is not a vector multiple
          std::vector<float> kt = uniform(d * ld, -2.0f, 2.0f, static_cast<unsigned>(d * 1000 + n));
          std::vector<float> q = uniform(nq * d, -2.0f, 2.0f, static_cast<unsigned>(nq * 7 + d));
          std::vector<float> out(nq * ld, -1.0f);
          kernels::dot_columns_f32(kt.data(), ld, n, d, q.data(), nq, out.data(), ld);
          for (std::size_t b = 0; b < nq; ++b) {
            for (std::size_t i = 0; i < n; ++i) {
              double want = 0;
              for (std::size_t j = 0; j < d; ++j) want += double(q[b * d + j]) * kt[j * ld + i];
              ASSERT_NEAR(out[b * ld + i], want, 1e-5 * (1.0 + double(d))) << "d=" << d << " n=" << n << " nq=" << nq << " b=" << b << " i=" << i;
            }
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace kvslim
