// ZipCache quantizer level: the zipcache document's Evidence claims, the original's
// tests/quantizers/test_zipcache.py inventory (seed-behaviour.md §5.3) and the §4.3 byte table.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvslim/dtype.h"
#include "kvslim/errors.h"
#include "kvslim/zipcache.h"

namespace kvslim {
namespace {

std::vector<float> gaussian(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += double(a[i]) * b[i];
    aa += double(a[i]) * a[i];
    bb += double(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

std::vector<float> to_f32(const std::vector<std::uint16_t>& h) {
  std::vector<float> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = fp16_to_f32(h[i]);
  return v;
}

double mse(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return s / a.size();
}

std::size_t count(const std::vector<std::uint8_t>& m) {
  std::size_t n = 0;
  for (auto x : m) n += x;
  return n;
}

// ---- saliency ----

TEST(ZipSaliency, TokenKeyNormsShape) {
  const auto x = gaussian(16 * 64, 1);
  const auto n = token_key_norms(x, 16, 64);
  ASSERT_EQ(n.size(), 16u);
  double s = 0;
  for (std::size_t c = 0; c < 64; ++c) s += double(x[3 * 64 + c]) * x[3 * 64 + c];
  EXPECT_NEAR(n[3], std::sqrt(s), 1e-12);
}

TEST(ZipSaliency, SelectsTopFraction) {  // Evidence: exactly the top hi_fraction by key norm
  std::mt19937 rng(0);
  std::normal_distribution<double> z(0, 1);
  std::vector<double> norms(20);
  for (auto& v : norms) v = z(rng) * z(rng) + 0.01;
  const auto m = saliency_mask(norms, 0.25);
  EXPECT_EQ(count(m), 5u);
  double min_hi = 1e30, max_lo = -1e30;
  for (std::size_t i = 0; i < 20; ++i) (m[i] ? min_hi : max_lo) = m[i] ? std::min(min_hi, norms[i]) : std::max(max_lo, norms[i]);
  EXPECT_GT(min_hi, max_lo);
}

TEST(ZipSaliency, SelectsHighestNorms) {
  std::vector<double> norms(10);
  for (int i = 0; i < 10; ++i) norms[i] = i;
  const auto m = saliency_mask(norms, 0.3);
  EXPECT_EQ(m, (std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 1, 1, 1}));
}

TEST(ZipSaliency, ZeroAndFullFraction) {
  const std::vector<double> norms = {3, 1, 4, 1, 5, 9, 2, 6};
  EXPECT_EQ(count(saliency_mask(norms, 0.0)), 0u);
  EXPECT_EQ(count(saliency_mask(norms, 1.0)), 8u);
}

TEST(ZipSaliency, TiesGoToLaterIndices) {
  const std::vector<double> norms = {1, 2, 2, 2, 0};
  EXPECT_EQ(saliency_mask(norms, 0.4), (std::vector<std::uint8_t>{0, 0, 1, 1, 0}));
}

TEST(ZipSaliency, SameSetAsAStableSortOnManyTies) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t S = 1 + rng() % 300;
    std::vector<double> norms(S);
    for (auto& v : norms) v = static_cast<double>(rng() % 7);  // heavy ties
    const double hf = (rng() % 101) / 100.0;
    std::vector<std::size_t> order(S);
    for (std::size_t i = 0; i < S; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return norms[a] < norms[b]; });
    std::vector<std::uint8_t> expected(S, 0);
    const std::size_t n_hi = salient_count(S, hf);
    for (std::size_t r = S - n_hi; r < S; ++r) expected[order[r]] = 1;
    EXPECT_EQ(saliency_mask(norms, hf), expected) << S << " " << hf;
  }
  EXPECT_THROW(saliency_mask(std::vector<double>{1.0, std::nan(""), 2.0}, 0.5), std::invalid_argument);
}

TEST(ZipSaliency, CountUsesDoublePrecision) {
  // With float, ceil(0.3f * 100) = 31; the original computes in double: 30.
  EXPECT_EQ(salient_count(100, 0.3), 30u);
  EXPECT_EQ(salient_count(64, 0.2), 13u);
  EXPECT_EQ(salient_count(1, 0.2), 1u);
  EXPECT_EQ(salient_count(0, 0.5), 0u);
  EXPECT_THROW(salient_count(10, 1.5), std::invalid_argument);
  EXPECT_THROW(salient_count(10, -0.2), std::invalid_argument);
}

// ---- group quantization ----

TEST(ZipQuant, FourBitNearLossless) {  // Evidence: 4-bit channel quant cosine > 0.995
  const auto x = gaussian(64 * 128, 2);
  const auto y = dequantize_groups(quantize_groups(x, 64, 128, 4, 32));
  EXPECT_GT(cosine(x, y), 0.995);
}

TEST(ZipQuant, TwoBitLossyBounded) {  // Evidence: 2-bit cosine > 0.8
  const auto x = gaussian(64 * 128, 3);
  const auto y = dequantize_groups(quantize_groups(x, 64, 128, 2, 32));
  const double c = cosine(x, y);
  EXPECT_GT(c, 0.8);
  EXPECT_LT(c, 0.99);  // and it is lossy
}

// ---- compress / reconstruct ----

TEST(ZipCompress, ReturnsState) {
  const auto x = gaussian(32 * 64, 4);
  const auto z = zip_compress(x, 32, 64, 4, 2, 0.2, 32);
  EXPECT_EQ(z.seq_len, 32u);
  EXPECT_EQ(z.head_dim, 64u);
  EXPECT_EQ(z.n_hi, 7u);
  EXPECT_EQ(z.hi.rows + z.lo.rows, 32u);
  EXPECT_EQ(z.hi.bits, 4);
  EXPECT_EQ(z.lo.bits, 2);
}

TEST(ZipCompress, ReconstructShapePreservedAsFp16) {  // Evidence: [S, D] shape, fp16
  const auto x = gaussian(48 * 128, 5);
  const std::vector<std::uint16_t> y = zip_reconstruct(zip_compress(x, 48, 128, 4, 2, 0.2, 32));
  EXPECT_EQ(y.size(), 48u * 128u);
}

TEST(ZipCompress, AllHiBeatsAllLo) {  // Evidence: hf=1 has lower MSE than hf=0
  const auto x = gaussian(64 * 128, 6);
  const double hi = mse(x, to_f32(zip_reconstruct(zip_compress(x, 64, 128, 4, 2, 1.0, 32))));
  const double lo = mse(x, to_f32(zip_reconstruct(zip_compress(x, 64, 128, 4, 2, 0.0, 32))));
  EXPECT_LT(hi, lo);
}

TEST(ZipCompress, EdgeFractionsRun) {  // Evidence: hf 0 and 1 run without error
  const auto x = gaussian(40 * 16, 7);
  for (double hf : {0.0, 1.0}) {
    const auto z = zip_compress(x, 40, 16, 4, 2, hf, 32);
    EXPECT_EQ(z.n_hi, hf == 0.0 ? 0u : 40u);
    EXPECT_TRUE(z.mask_bits.empty());  // uniform precision: no mask stored
    EXPECT_EQ(zip_reconstruct(z).size(), 40u * 16u);
  }
}

TEST(ZipCompress, SalientRowsGetHiPrecision) {
  // High-norm outlier rows (x5) are routed to hi and reconstructed better than the rest.
  const std::size_t S = 128, D = 64;
  auto x = gaussian(S * D, 8);
  for (std::size_t r = 0; r < S; r += 10)
    for (std::size_t c = 0; c < D; ++c) x[r * D + c] *= 5;
  const auto z = zip_compress(x, S, D, 4, 2, 0.1, 32);
  const auto m = z.mask();
  for (std::size_t r = 0; r < S; r += 10) EXPECT_EQ(m[r], 1) << r;
  EXPECT_EQ(count(m), 13u);
}

TEST(ZipCompress, GroupSizeIsStoredAndUsed) {  // #78: reconstruct uses the compress-time group size
  const auto x = gaussian(40 * 8, 9);
  const auto z8 = zip_compress(x, 40, 8, 4, 2, 0.2, 8);
  EXPECT_EQ(z8.group_size, 8u);
  EXPECT_EQ(z8.lo.group_size, 8u);
  const auto z32 = zip_compress(x, 40, 8, 4, 2, 0.2, 32);
  const double e8 = mse(x, to_f32(zip_reconstruct(z8))), e32 = mse(x, to_f32(zip_reconstruct(z32)));
  EXPECT_LT(e8, 2 * e32);
  EXPECT_LT(e8, e32);  // smaller groups: tighter ranges
}

TEST(ZipCompress, Deterministic) {
  const auto x = gaussian(64 * 32, 10);
  EXPECT_EQ(zip_reconstruct(zip_compress(x, 64, 32, 4, 2, 0.2, 32)),
            zip_reconstruct(zip_compress(x, 64, 32, 4, 2, 0.2, 32)));
}

TEST(ZipCompress, ReconstructMatchesSetDequantization) {  // #408: one shared group quantizer
  const std::size_t S = 97, D = 64;
  const auto x = gaussian(S * D, 11);
  for (int bits : {2, 3, 4}) {
    // hf = 1 puts every row in the hi set: the block is exactly quantize_groups of the rows.
    const auto z = zip_compress(x, S, D, bits, bits, 1.0, 32);
    const auto q = dequantize_groups(quantize_groups(x, S, D, bits, 32));
    const auto y = zip_reconstruct(z);
    for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], f32_to_fp16(q[i])) << bits << " " << i;
  }
}

TEST(ZipCompress, HiGroupsAreConsecutiveWithinTheSet) {
  // Salient rows far apart share a group: their params are those of the hi set's first group.
  const std::size_t S = 64, D = 4;
  auto x = gaussian(S * D, 12);
  const auto z = zip_compress(x, S, D, 4, 2, 0.2, 32);
  EXPECT_EQ(z.hi.groups(), 1u);  // 13 hi rows
  EXPECT_EQ(z.lo.groups(), 2u);  // 51 lo rows
}

TEST(ZipCompress, EmptyBlock) {
  const auto z = zip_compress({}, 0, 16, 4, 2, 0.2, 32);
  EXPECT_EQ(z.seq_len, 0u);
  EXPECT_TRUE(zip_reconstruct(z).empty());
  EXPECT_EQ(z.resident_bytes(), 0u);
}

TEST(ZipCompress, NonFiniteKeysRejected) {
  auto x = gaussian(8 * 16, 13);
  x[5 * 16 + 2] = INFINITY;
  try {
    zip_compress(x, 8, 16, 4, 2, 0.2, 32);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rows[5, 2]"), std::string::npos) << e.what();
  }
  x[5 * 16 + 2] = std::nanf("");
  EXPECT_THROW(zip_compress(x, 8, 16, 4, 2, 0.2, 32), InputError);
}

// ---- §4.3 byte accounting ----

struct Row {
  std::size_t S;
  double hf;
  std::size_t n_hi, bytes;
};

TEST(ZipBytes, AccountedTableOfSection43) {
  const Row rows[] = {{64, 0.2, 13, 4064},      {128, 0.1, 13, 7200},     {128, 0.2, 26, 7616},
                      {128, 0.3, 39, 8032},     {512, 0.1, 52, 27264},    {512, 0.2, 103, 28896},
                      {512, 0.3, 154, 30528},   {2048, 0.1, 205, 107424}, {2048, 0.2, 410, 113984},
                      {2048, 0.3, 615, 120544}, {1, 0.2, 1, 577}};
  for (const Row& r : rows) {
    const std::size_t n_hi = salient_count(r.S, r.hf);
    EXPECT_EQ(n_hi, r.n_hi) << r.S << " " << r.hf;
    EXPECT_EQ(zipcache_accounted_bytes(n_hi, r.S - n_hi, r.S, 128, 4, 2, 32), r.bytes) << r.S << " " << r.hf;
  }
  EXPECT_EQ(base_only_bytes(64, 128, 2, 32), 3072u);
  EXPECT_EQ(base_only_bytes(128, 128, 2, 32), 6144u);
  EXPECT_EQ(base_only_bytes(512, 128, 2, 32), 24576u);
  EXPECT_EQ(base_only_bytes(2048, 128, 2, 32), 98304u);
  // Figures of the table: S=64 -> 3.969 bits, ratio 4.03; S=2048 hf .3 -> 3.679 / 4.35; decode 36.06.
  EXPECT_NEAR(16.0 * 4064 / (64 * 128 * 2), 3.969, 5e-4);
  EXPECT_NEAR(16.0 * 120544 / (2048 * 128 * 2), 3.679, 5e-4);
  EXPECT_NEAR(16.0 * 577 / 256, 36.06, 5e-3);
  // Values at S=64, all hi: 5184 bytes per head; prefill 32 + 3 decode tokens: 4035 bytes.
  EXPECT_EQ(zipcache_accounted_bytes(64, 0, 64, 128, 4, 4, 32), 5184u);
  EXPECT_EQ(zipcache_accounted_bytes(7, 25, 32, 128, 4, 2, 32) + 3 * zipcache_accounted_bytes(1, 0, 1, 128, 4, 2, 32),
            4035u);
}

TEST(ZipBytes, OrderingLoBaselineCompressedFp16) {  // Evidence: baseline <= compressed < fp16
  for (std::size_t S : {32u, 64u, 128u, 512u, 2048u}) {
    for (double hf : {0.0, 0.1, 0.2, 0.3, 1.0}) {
      const std::size_t n_hi = salient_count(S, hf);
      const std::size_t comp = zipcache_accounted_bytes(n_hi, S - n_hi, S, 128, 4, 2, 32);
      EXPECT_LT(comp, S * 128 * 2) << S << " " << hf;
      EXPECT_GE(comp, base_only_bytes(S, 128, 2, 32)) << S << " " << hf;
      const double bits = 16.0 * comp / (S * 128 * 2);
      if (hf > 0 && hf < 1 && S >= 128) {  // Evidence: effective bits in [lo, hi] (S >= 128)
        EXPECT_GE(bits, 2.0);
        EXPECT_LE(bits, 4.0) << S << " " << hf;
      }
    }
  }
  // At S = 64 it holds only up to hf 0.2 (3.969 bits); hf 0.3 gives 4.19.
  EXPECT_GT(16.0 * zipcache_accounted_bytes(20, 44, 64, 128, 4, 2, 32) / (64 * 128 * 2), 4.0);
  // At S = 32 a partial hi group already breaks the range (§8 item 12): 4.5 bits at hf 0.2.
  EXPECT_GT(16.0 * zipcache_accounted_bytes(7, 25, 32, 128, 4, 2, 32) / (32 * 128 * 2), 4.0);
  // ... and compressed < fp16 is not "always": a lone decode token costs more than fp16 (seed-behaviour.md §8 item 13).
  EXPECT_GT(zipcache_accounted_bytes(1, 0, 1, 128, 4, 2, 32), 256u);
}

TEST(ZipBytes, ResidentIsPackedCodesFp16ParamsAndBitMask) {
  const std::size_t S = 64, D = 128;
  const auto x = gaussian(S * D, 14);
  const auto z = zip_compress(x, S, D, 4, 2, 0.2, 32);
  // Accounted counts the mask as S bytes; kvslim stores it as S bits.
  EXPECT_EQ(z.resident_bytes(), zipcache_accounted_bytes(13, 51, S, D, 4, 2, 32) - S + S / 8);
  EXPECT_EQ(z.resident_bytes(), 4008u);
  // Below fp16 for any block of at least one group, all widths.
  const auto big = gaussian(100 * D, 15);
  for (int hi = 1; hi <= 8; ++hi) {
    for (int lo = 1; lo <= hi; ++lo) {
      for (std::size_t s : {32u, 33u, 64u, 100u}) {
        const auto zz = zip_compress(std::span<const float>(big).subspan(0, s * D), s, D, hi, lo, 0.2, 32);
        EXPECT_LT(zz.resident_bytes(), s * D * 2) << hi << " " << lo << " " << s;
      }
    }
  }
}

}  // namespace
}  // namespace kvslim
