#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kvslim/convert.h"
#include "kvslim/dtype.h"

namespace kvslim {
namespace {

TEST(Fp16, EveryHalfConvertsExactlyAndRoundTrips) {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> wide(65536);
  convert_fp16_to_f32(all.data(), wide.data(), all.size());
  std::vector<std::uint16_t> back(65536);
  convert_f32_to_fp16(wide.data(), back.data(), wide.size());
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float scalar = fp16_to_f32(all[i]);
    if (std::isnan(scalar)) {
      EXPECT_TRUE(std::isnan(wide[i])) << i;
      EXPECT_EQ(back[i] & 0x7c00, 0x7c00) << i;
      continue;
    }
    ASSERT_EQ(std::memcmp(&scalar, &wide[i], 4), 0) << "half " << i;
    ASSERT_EQ(back[i], all[i]) << "half " << i;
  }
}

TEST(Fp16, KnownValues) {
  EXPECT_EQ(f32_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);            // rounds up to infinity
  EXPECT_EQ(f32_to_fp16(5.9604645e-8f), 0x0001);       // smallest subnormal
  EXPECT_EQ(f32_to_fp16(1.0f + 1.0f / 2048), 0x3c00);  // tie -> even
  EXPECT_EQ(f32_to_fp16(1.0f + 3.0f / 2048), 0x3c02);  // tie -> even (up)
  EXPECT_FLOAT_EQ(fp16_to_f32(0x3555), 0.33325195f);
}

TEST(Fp16, SimdRoundingMatchesScalarOnRandomFloats) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::vector<float> x(100003);
  for (auto& f : x) {
    do {
      f = std::bit_cast<float>(bits(rng) & 0xc7ffffffu);  // exponents spanning fp16's range and beyond
    } while (std::isnan(f));
  }
  std::vector<std::uint16_t> h(x.size());
  convert_f32_to_fp16(x.data(), h.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(h[i], f32_to_fp16(x[i])) << x[i];
}

TEST(Bf16, ConvertsAndRoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  std::vector<std::uint16_t> b = {0x3f80, 0xc000, 0x0000, 0x4049, 0x3f80, 0xc000, 0x0000, 0x4049, 0x1234};
  std::vector<float> f(b.size());
  convert_to_f32(b.data(), DType::bf16, f.data(), b.size());
  for (std::size_t i = 0; i < b.size(); ++i) EXPECT_EQ(f[i], bf16_to_f32(b[i]));
}

TEST(DotRows, MatchesNaiveForOddSizes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  for (std::size_t d : {1u, 7u, 16u, 33u, 64u, 128u, 131u}) {
    const std::size_t n = 9, stride = d + 3;
    std::vector<std::uint16_t> rows(n * stride);
    for (auto& r : rows) r = f32_to_fp16(dist(rng));
    std::vector<float> q(d), out(n);
    for (auto& x : q) x = dist(rng);
    dot_fp16_rows(rows.data(), n, d, stride, q.data(), out.data());
    for (std::size_t i = 0; i < n; ++i) {
      double ref = 0;
      for (std::size_t j = 0; j < d; ++j) ref += double(fp16_to_f32(rows[i * stride + j])) * q[j];
      EXPECT_NEAR(out[i], ref, 1e-4 * (1 + std::abs(ref))) << "d=" << d;
    }
    std::vector<float> acc(d, 1.0f);
    axpy_fp16_row(0.5f, rows.data(), d, acc.data());
    for (std::size_t j = 0; j < d; ++j) EXPECT_FLOAT_EQ(acc[j], 1.0f + 0.5f * fp16_to_f32(rows[j]));
  }
  EXPECT_NE(std::string(simd_target_name()), "");
}

}  // namespace
}  // namespace kvslim
