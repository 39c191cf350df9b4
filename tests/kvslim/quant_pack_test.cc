// Bit packing and the group quantizer: round trips for every width and odd shapes, the §4.2
// formulas against a direct transcription, and the stored-byte counts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvslim/dtype.h"
#include "kvslim/errors.h"
#include "kvslim/zipcache.h"
#include "quant/group_quant.h"
#include "quant/quant_kernels.h"

namespace kvslim {
namespace {

std::vector<float> gaussian(std::size_t n, unsigned seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<std::uint8_t> random_codes(std::size_t n, int bits, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, (1 << bits) - 1);
  std::vector<std::uint8_t> v(n);
  for (auto& c : v) c = static_cast<std::uint8_t>(dist(rng));
  return v;
}

TEST(QuantPack, PackedRowBytesIsBitsTimesDimRoundedPerPlane) {
  EXPECT_EQ(packed_row_bytes(128, 4), 64u);
  EXPECT_EQ(packed_row_bytes(128, 2), 32u);
  EXPECT_EQ(packed_row_bytes(128, 3), 48u);
  EXPECT_EQ(packed_row_bytes(128, 8), 128u);
  EXPECT_EQ(packed_row_bytes(5, 1), 1u);
  EXPECT_EQ(packed_row_bytes(5, 7), 3u + 2u + 1u);  // planes 4, 2, 1: ceil(20/8) + ceil(10/8) + ceil(5/8)
  for (int bits = 1; bits <= 8; ++bits) {
    for (std::size_t d : {1u, 7u, 64u, 100u, 127u, 128u}) {
      EXPECT_GE(packed_row_bytes(d, bits) * 8, d * static_cast<std::size_t>(bits));
      EXPECT_LE(packed_row_bytes(d, bits) * 8, d * static_cast<std::size_t>(bits) + 4 * 7);
    }
  }
}

TEST(QuantPack, RoundTripsEveryWidthAndOddSizes) {
  for (const auto* k : {&quant::scalar_kernels(), &quant::simd_kernels()}) {
    for (int bits = 1; bits <= 8; ++bits) {
      for (std::size_t dim : {1u, 3u, 8u, 13u, 64u, 100u, 127u, 128u, 129u, 257u}) {
        for (std::size_t n : {0u, 1u, 5u, 33u}) {
          const auto codes = random_codes(n * dim, bits, static_cast<unsigned>(bits * 1000 + dim + n));
          std::vector<std::uint8_t> packed(n * packed_row_bytes(dim, bits) + 1, 0xAB);
          k->pack_rows(codes.data(), n, dim, bits, packed.data());
          EXPECT_EQ(packed.back(), 0xAB) << "pack wrote past the end";
          std::vector<std::uint8_t> back(n * dim + 1, 0xCD);
          k->unpack_rows(packed.data(), n, dim, bits, back.data());
          EXPECT_EQ(back.back(), 0xCD) << "unpack wrote past the end";
          back.pop_back();
          ASSERT_EQ(back, codes) << k->name << " bits=" << bits << " dim=" << dim << " n=" << n;
        }
      }
    }
  }
}

TEST(QuantPack, LayoutIsPlanarAcrossTheRow) {
  // 2-bit codes of a 4-wide row: m = 1 byte holding elements 0..3 at bit offsets 0, 2, 4, 6.
  const std::vector<std::uint8_t> codes = {1, 2, 3, 0};
  std::uint8_t packed = 0;
  quant::scalar_kernels().pack_rows(codes.data(), 1, 4, 2, &packed);
  EXPECT_EQ(packed, 1u | (2u << 2) | (3u << 4));
  // 3-bit codes: plane 2 (low bits) then plane 1 (bit 2).
  const std::vector<std::uint8_t> c3 = {5, 7, 2, 4};
  std::uint8_t p3[2] = {0, 0};
  quant::scalar_kernels().pack_rows(c3.data(), 1, 4, 3, p3);
  EXPECT_EQ(p3[0], 1u | (3u << 2) | (2u << 4) | (0u << 6));
  EXPECT_EQ(p3[1], 1u | (1u << 1) | (0u << 2) | (1u << 3));
}

// Direct transcription of §4.2 with the fp16 parameter rule, element by element.
float reference_reconstruct(const std::vector<float>& x, std::size_t n, std::size_t dim, int bits, std::size_t gs,
                            std::size_t r, std::size_t c) {
  const std::size_t g0 = (r / gs) * gs, g1 = std::min(n, g0 + gs);
  float mn = x[g0 * dim + c], mx = mn;
  for (std::size_t i = g0; i < g1; ++i) {
    mn = std::min(mn, x[i * dim + c]);
    mx = std::max(mx, x[i * dim + c]);
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const float zero = fp16_to_f32(f32_to_fp16(mn));
  const float s = std::max((mx - zero) / levels, 1e-8f);
  std::uint16_t sh = f32_to_fp16(s);
  if (fp16_to_f32(sh) < s) ++sh;
  const float scale = fp16_to_f32(sh);
  const float code = std::min(std::max(std::nearbyint((x[r * dim + c] - zero) / scale), 0.0f), levels);
  return code * scale + zero;
}

TEST(GroupQuant, MatchesTheFormulaElementByElement) {
  const std::size_t n = 97, dim = 64;  // 97 rows: three full groups of 32 and a 1-row group
  const auto x = gaussian(n * dim, 11);
  for (int bits : {2, 3, 4}) {
    const auto q = quantize_groups(x, n, dim, bits, 32);
    const auto y = dequantize_groups(q);
    for (std::size_t r = 0; r < n; ++r) {
      for (std::size_t c = 0; c < dim; ++c) {
        ASSERT_EQ(y[r * dim + c], reference_reconstruct(x, n, dim, bits, 32, r, c)) << r << "," << c;
      }
    }
  }
}

TEST(GroupQuant, StoredBytesAreCodesPlusFp16Params) {
  const std::size_t n = 70, dim = 100;
  const auto x = gaussian(n * dim, 5);
  const auto q = quantize_groups(x, n, dim, 3, 32);
  EXPECT_EQ(q.groups(), 3u);
  EXPECT_EQ(q.codes.size(), n * packed_row_bytes(dim, 3));
  EXPECT_EQ(q.scale.size(), 3 * dim);
  EXPECT_EQ(q.resident_bytes(), q.codes.capacity() + 2 * 2 * q.scale.capacity());
  EXPECT_EQ(q.resident_bytes(), n * packed_row_bytes(dim, 3) + 3 * dim * 4);
}

TEST(GroupQuant, DegenerateGroupsAreLossless) {
  // A 1-row group and a group of identical rows: gmax == gmin, reconstructed exactly (fp16 inputs).
  const std::size_t dim = 16;
  std::vector<float> x(33 * dim);
  for (std::size_t r = 0; r < 32; ++r)
    for (std::size_t c = 0; c < dim; ++c) x[r * dim + c] = fp16_to_f32(f32_to_fp16(0.37f * c - 2.0f));
  for (std::size_t c = 0; c < dim; ++c) x[32 * dim + c] = fp16_to_f32(f32_to_fp16(1.5f * c + 0.001f));
  for (int bits = 1; bits <= 8; ++bits) {
    const auto y = dequantize_groups(quantize_groups(x, 33, dim, bits, 32));
    EXPECT_EQ(y, x) << bits;
  }
}

TEST(GroupQuant, EmptyInputGivesEmptyCodesAndParams) {
  const auto q = quantize_groups({}, 0, 64, 4, 32);
  EXPECT_EQ(q.rows, 0u);
  EXPECT_EQ(q.dim, 64u);
  EXPECT_EQ(q.groups(), 0u);
  EXPECT_TRUE(q.codes.empty());
  EXPECT_TRUE(q.scale.empty());
  EXPECT_TRUE(q.zero.empty());
  EXPECT_TRUE(dequantize_groups(q).empty());
}

TEST(GroupQuant, RejectsBadArgumentsAndValues) {
  std::vector<float> x(4 * 8, 1.0f);
  EXPECT_THROW(quantize_groups(x, 4, 8, 0, 32), std::invalid_argument);
  EXPECT_THROW(quantize_groups(x, 4, 8, 9, 32), std::invalid_argument);
  EXPECT_THROW(quantize_groups(x, 4, 8, 4, 0), std::invalid_argument);
  EXPECT_THROW(quantize_groups(x, 5, 8, 4, 32), std::invalid_argument);
  x[2 * 8 + 3] = std::nanf("");
  try {
    quantize_groups(x, 4, 8, 4, 32);
    FAIL() << "NaN accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rows[2, 3]"), std::string::npos) << e.what();
  }
  x[2 * 8 + 3] = INFINITY;
  EXPECT_THROW(quantize_groups(x, 4, 8, 4, 32), InputError);
  x[2 * 8 + 3] = 1e6f;  // finite but not representable in the fp16 view
  EXPECT_THROW(quantize_groups(x, 4, 8, 4, 32), InputError);
}

TEST(GroupQuant, ErrorShrinksWithBits) {
  const std::size_t n = 64, dim = 128;
  const auto x = gaussian(n * dim, 2);
  double prev = 1e30;
  for (int bits = 1; bits <= 8; ++bits) {
    const auto y = dequantize_groups(quantize_groups(x, n, dim, bits, 32));
    double mse = 0;
    for (std::size_t i = 0; i < x.size(); ++i) mse += (x[i] - y[i]) * (x[i] - y[i]);
    EXPECT_LT(mse, prev) << bits;
    prev = mse;
  }
}

}  // namespace
}  // namespace kvslim
