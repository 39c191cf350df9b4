// The SIMD kernels give exactly the scalar reference's bytes, on every instruction set this
// machine supports (Highway targets switched one by one).
#include <gtest/gtest.h>


#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "simd_targets.h"
#include "kvslim/dtype.h"
#include "kvslim/zipcache.h"
#include "quant/group_quant.h"
#include "quant/quant_kernels.h"

namespace kvslim {
namespace {

std::vector<float> gaussian(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

using testing::for_each_target;

TEST(QuantSimd, EncodePackDecodeBitIdenticalToScalar) {
  const auto& ref = quant::scalar_kernels();
  const auto& simd = quant::simd_kernels();
  for_each_target([&] {
    for (int bits = 1; bits <= 8; ++bits) {
      for (std::size_t dim : {1u, 7u, 64u, 100u, 128u, 131u}) {
        const std::size_t n = 45;
        auto x = gaussian(n * dim, static_cast<unsigned>(bits * 100 + dim));
        x[0] = 0.0f;
        if (x.size() > 3) x[3] = 1e-7f;  // fp16 subnormal range in the outputs
        for (auto group_size : {1u, 8u, 32u}) {
          std::vector<const float*> rows(n);
          for (std::size_t r = 0; r < n; ++r) rows[r] = x.data() + r * dim;
          const auto qr = quant::quantize_row_set(rows.data(), n, dim, bits, group_size, ref);
          const auto qs = quant::quantize_row_set(rows.data(), n, dim, bits, group_size, simd);
          ASSERT_EQ(qr.codes, qs.codes) << "bits=" << bits << " dim=" << dim;
          ASSERT_EQ(qr.scale, qs.scale);
          ASSERT_EQ(qr.zero, qs.zero);
          std::vector<std::uint16_t> yr(n * dim), ys(n * dim);
          std::vector<std::uint16_t*> pr(n), ps(n);
          for (std::size_t r = 0; r < n; ++r) {
            pr[r] = yr.data() + r * dim;
            ps[r] = ys.data() + r * dim;
          }
          quant::decode_set_f16(qr, pr.data(), ref);
          quant::decode_set_f16(qs, ps.data(), simd);
          ASSERT_EQ(yr, ys) << "bits=" << bits << " dim=" << dim;
          std::vector<float> fr(n * dim), fs(n * dim);
          std::vector<float*> qfr(n), qfs(n);
          for (std::size_t r = 0; r < n; ++r) {
            qfr[r] = fr.data() + r * dim;
            qfs[r] = fs.data() + r * dim;
          }
          quant::decode_set_f32(qr, qfr.data(), ref);
          quant::decode_set_f32(qs, qfs.data(), simd);
          ASSERT_EQ(0, std::memcmp(fr.data(), fs.data(), fr.size() * sizeof(float)));
        }
      }
    }
  });
}

TEST(QuantSimd, ConversionsBitIdenticalToScalar) {
  const auto& ref = quant::scalar_kernels();
  const auto& simd = quant::simd_kernels();
  // Every fp16 and bf16 bit pattern, and floats around the fp16 rounding boundaries.
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> probe;
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const std::uint32_t bits = rng();
    probe.push_back(std::bit_cast<float>(bits & 0xC7FFFFFFu));  // exponents up to about 2^16
  }
  for (std::uint32_t h = 0; h < 0x7c00; h += 7) {  // exact halfway points between fp16 neighbours
    probe.push_back(std::nextafter(fp16_to_f32(static_cast<std::uint16_t>(h)), 1e9f));
    probe.push_back((fp16_to_f32(static_cast<std::uint16_t>(h)) + fp16_to_f32(static_cast<std::uint16_t>(h + 1))) / 2);
  }
  probe.push_back(INFINITY);
  probe.push_back(-INFINITY);
  probe.push_back(70000.0f);
  probe.push_back(65519.0f);
  for_each_target([&] {
    for (DType t : {DType::f16, DType::bf16}) {
      std::vector<float> a(all.size()), b(all.size());
      ref.to_f32(all.data(), t, a.data(), all.size());
      simd.to_f32(all.data(), t, b.data(), all.size());
      for (std::size_t i = 0; i < all.size(); ++i) {
        if (std::isnan(a[i])) {  // NaN payloads may differ (F16C quiets signalling NaNs); NaN stays NaN
          ASSERT_TRUE(std::isnan(b[i])) << dtype_name(t) << " pattern " << i;
        } else {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(a[i]), std::bit_cast<std::uint32_t>(b[i]))
              << dtype_name(t) << " pattern " << i;
        }
      }
    }
    std::vector<std::uint16_t> ha(probe.size()), hb(probe.size());
    ref.f32_to_f16(probe.data(), ha.data(), probe.size());
    simd.f32_to_f16(probe.data(), hb.data(), probe.size());
    ASSERT_EQ(ha, hb);
  });
}

TEST(QuantSimd, GroupParametersBitIdenticalToScalar) {
  const auto& ref = quant::scalar_kernels();
  const auto& simd = quant::simd_kernels();
  // Ordinary ranges, degenerate channels, tiny and huge (above 65504 for 1 bit) ranges, odd dim.
  const std::size_t dim = 77;
  std::vector<float> mn(dim), mx(dim);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (std::size_t c = 0; c < dim; ++c) {
    mn[c] = dist(rng);
    mx[c] = mn[c] + std::fabs(dist(rng));
  }
  mx[1] = mn[1];
  mn[2] = 1e-7f, mx[2] = 3e-7f;
  mn[3] = -65504.0f, mx[3] = 65504.0f;
  mn[4] = 1000.1f, mx[4] = 1000.1f;
  mn[20] = -60000.0f, mx[20] = 60000.0f;
  for_each_target([&] {
    for (int bits = 1; bits <= 8; ++bits) {
      std::vector<std::uint16_t> sh_r(dim), zh_r(dim), sh_s(dim), zh_s(dim);
      std::vector<float> sf_r(dim), zf_r(dim), sf_s(dim), zf_s(dim), sf_b(dim), zf_b(dim);
      ref.make_params(mn.data(), mx.data(), dim, bits, sh_r.data(), zh_r.data(), sf_r.data(), zf_r.data());
      simd.make_params(mn.data(), mx.data(), dim, bits, sh_s.data(), zh_s.data(), sf_s.data(), zf_s.data());
      ASSERT_EQ(sh_r, sh_s) << bits;
      ASSERT_EQ(zh_r, zh_s) << bits;
      ASSERT_EQ(0, std::memcmp(sf_r.data(), sf_s.data(), dim * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(zf_r.data(), zf_s.data(), dim * sizeof(float)));
      simd.params_to_f32(sh_s.data(), zh_s.data(), dim, sf_b.data(), zf_b.data());
      ASSERT_EQ(0, std::memcmp(sf_r.data(), sf_b.data(), dim * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(zf_r.data(), zf_b.data(), dim * sizeof(float)));
      for (std::size_t c = 0; c < dim; ++c) {
        const float levels = static_cast<float>((1 << bits) - 1);
        if ((mx[c] - mn[c]) / levels <= 65504.0f) {  // else the scale saturates at the largest fp16
          EXPECT_GE(sf_r[c] * levels + zf_r[c], mx[c] - 1e-6f * std::fabs(mx[c])) << c;  // gmax in range
        }
        EXPECT_LE(sh_r[c], 0x7bffu);
      }
    }
  });
}

TEST(QuantSimd, ChecksAndNormsAgree) {
  const auto& ref = quant::scalar_kernels();
  const auto& simd = quant::simd_kernels();
  for_each_target([&] {
    for (std::size_t n : {1u, 15u, 16u, 17u, 100u}) {
      for (std::size_t bad = 0; bad <= n; bad += 7) {
        auto x = gaussian(n, static_cast<unsigned>(n));
        if (bad < n) x[bad] = (bad % 2) ? std::nanf("") : 65600.0f;
        EXPECT_EQ(ref.first_unrepresentable(x.data(), n), simd.first_unrepresentable(x.data(), n));
        EXPECT_EQ(simd.first_unrepresentable(x.data(), n), bad < n ? bad : n);
      }
      const auto x = gaussian(n, 3);
      EXPECT_NEAR(ref.sum_squares(x.data(), n), simd.sum_squares(x.data(), n), 1e-12 * n);
      // fp16 rows: norms agree, row conversion is exact.
      std::vector<std::uint16_t> h(3 * n);
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = f32_to_fp16(gaussian(3 * n, 4)[i]);
      const std::uint16_t* rows[3] = {h.data(), h.data() + n, h.data() + 2 * n};
      double nr[3], ns[3];
      ref.row_norms_f16(rows, 3, n, nr);
      simd.row_norms_f16(rows, 3, n, ns);
      std::vector<float> fr(3 * n), fs(3 * n);
      ref.rows_f16_to_f32(rows, 3, n, fr.data());
      simd.rows_f16_to_f32(rows, 3, n, fs.data());
      EXPECT_EQ(fr, fs);
      for (int r = 0; r < 3; ++r) {
        EXPECT_NEAR(nr[r], ns[r], 1e-12 * nr[r]);
        EXPECT_NEAR(nr[r], std::sqrt(ref.sum_squares(fr.data() + r * n, n)), 1e-12 * nr[r]);
      }
    }
  });
}

}  // namespace
}  // namespace kvslim
