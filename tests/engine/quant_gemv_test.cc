// Block-quantized weights (engine/quant_gemv.h, the K-quant formats of engine/gguf.h):
//  - each format's decoding against hand-built blocks whose values follow from the published layout
//    (ggml-common.h / ggml-quants.c), computed here by an independent element-wise formula;
//  - the encoders' codes decode within one step of the input;
//  - the integer gemv and the SIMD dequantizer on every Highway target this machine has, against a
//    double-precision reference over the dequantized blocks;
//  - a random model as Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K GGUF: weights stay in their type in memory,
//    and decoding through the quantized kernels gives the greedy tokens and (nearly) the logits of
//    the same model run on the same weights dequantized to fp32.
#define HWY_WANT_AVX3_DL 1  // iterate over the VNNI target too (quant_gemv.cc compiles it)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <set>
#include <stdexcept>
#include <vector>

#include "engine/gguf.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/ops.h"
#include "engine/quant_gemv.h"
#include "engine/random_model.h"
#include "engine/sampler.h"
#include "kvslim/dtype.h"
#include "kvslim/simd_targets.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;
using gguf::TensorType;

void put_half(std::uint8_t* p, float v) {
  const std::uint16_t h = f32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

std::vector<float> decode(TensorType t, const std::vector<std::uint8_t>& bytes, std::size_t n) {
  std::vector<float> out(n);
  gguf::to_float(reinterpret_cast<const std::byte*>(bytes.data()), t, out.data(), n);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Golden decoding of hand-built blocks.


// Reference for a batch of activations: y[s * rows + r] = sum_c w[r, c] * x_s[c] in double, over
// the dequantized weights `wf` [rows, cols] and each activation as quantized (q8 codes times their
// block scale); `scale` gets the largest |weight| (the tolerances scale with it).
std::vector<double> reference_products(const std::vector<float>& wf, const std::vector<qgemv::Q8Blocks>& xs,
                                       std::size_t rows, std::size_t cols, double& scale) {
  std::vector<double> ref(xs.size() * rows);
  for (std::size_t s = 0; s < xs.size(); ++s) {
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = 0; c < cols; ++c) {
        ref[s * rows + r] += static_cast<double>(wf[r * cols + c]) * xs[s].q[c] * xs[s].d[c / 32];
        scale = std::max(scale, std::fabs(static_cast<double>(wf[r * cols + c])));
      }
    }
  }
  return ref;
}

TEST(KQuantBlocks, Q4_KDecodesAsPublished) {
  std::vector<std::uint8_t> b(144, 0);
  put_half(b.data(), 0.5f);       // d
  put_half(b.data() + 2, 0.25f);  // dmin
  // Sub-block scales 1..8 and mins 8..1 in the 12-byte 6-bit packing; sub-blocks 4..7 use the
  // high bits: scale 4+j | 32 (bit 5 set) to exercise them.
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = j < 4 ? j + 1 : 33 + j;
    mn[j] = j < 4 ? 8 - j : 40 - j;
  }
  std::uint8_t* s = b.data() + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<std::uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<std::uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<std::uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
  for (int i = 0; i < 128; ++i) b[16 + i] = static_cast<std::uint8_t>((i * 7 + 3) & 0xff);
  const std::vector<float> v = decode(TensorType::q4_k, b, 256);
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, l = e % 32;
    const int byte = b[16 + 32 * (j / 2) + l];
    const int q = j % 2 == 0 ? byte & 15 : byte >> 4;
    EXPECT_FLOAT_EQ(v[e], 0.5f * sc[j] * q - 0.25f * mn[j]) << "element " << e;
  }
  // Two values worked by hand: element 0: byte 3, low nibble 3, scale 1, min 8: 0.5*3 - 2 = -0.5.
  EXPECT_FLOAT_EQ(v[0], -0.5f);
  // element 32 (sub-block 1): byte 3 high nibble 0, min 7: -1.75.
  EXPECT_FLOAT_EQ(v[32], -1.75f);
}

TEST(KQuantBlocks, Q5_KAddsTheHighBitFromQh) {
  std::vector<std::uint8_t> b(176, 0);
  put_half(b.data(), 1.0f);
  put_half(b.data() + 2, 0.0f);
  std::uint8_t* s = b.data() + 4;
  for (int j = 0; j < 4; ++j) s[j] = 1;     // scales of sub-blocks 0..3 = 1
  for (int j = 8; j < 12; ++j) s[j] = 1;    // scales of sub-blocks 4..7 = 1 (mins 0)
  for (int l = 0; l < 32; ++l) b[16 + l] = static_cast<std::uint8_t>(l * 37 + 11);  // qh
  for (int i = 0; i < 128; ++i) b[48 + i] = static_cast<std::uint8_t>(i * 13 + 5);
  const std::vector<float> v = decode(TensorType::q5_k, b, 256);
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, l = e % 32;
    const int byte = b[48 + 32 * (j / 2) + l];
    const int q = (j % 2 == 0 ? byte & 15 : byte >> 4) | (((b[16 + l] >> j) & 1) << 4);
    EXPECT_FLOAT_EQ(v[e], static_cast<float>(q)) << "element " << e;
  }
  // By hand: element 0: qs byte 5 -> 5, qh[0] = 11 = 0b1011, bit 0 set -> 21.
  EXPECT_FLOAT_EQ(v[0], 21.0f);
  // element 32 (sub-block 1): qs byte 5 high nibble 0, qh[0] bit 1 set -> 16.
  EXPECT_FLOAT_EQ(v[32], 16.0f);
  // element 64 (sub-block 2): qs[32] = 32*13+5 = 421 & 255 = 165 = 0xA5, low 5, qh[0] bit 2 clear -> 5.
  EXPECT_FLOAT_EQ(v[64], 5.0f);
}

TEST(KQuantBlocks, Q6_KDecodesAsPublished) {
  std::vector<std::uint8_t> b(210, 0);
  for (int i = 0; i < 128; ++i) b[i] = static_cast<std::uint8_t>(i * 29 + 7);        // ql
  for (int i = 0; i < 64; ++i) b[128 + i] = static_cast<std::uint8_t>(i * 53 + 1);   // qh
  for (int g = 0; g < 16; ++g) b[192 + g] = static_cast<std::uint8_t>(static_cast<std::int8_t>(g - 8));
  put_half(b.data() + 208, 0.125f);
  const std::vector<float> v = decode(TensorType::q6_k, b, 256);
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 32; ++l) {
      const int ql0 = b[64 * half + l], ql1 = b[64 * half + l + 32], qh = b[128 + 32 * half + l];
      const int q[4] = {(ql0 & 15) | ((qh & 3) << 4), (ql1 & 15) | (((qh >> 2) & 3) << 4),
                        (ql0 >> 4) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | (((qh >> 6) & 3) << 4)};
      for (int k = 0; k < 4; ++k) {
        const int e = 128 * half + 32 * k + l;
        const int scale = static_cast<std::int8_t>(b[192 + e / 16]);
        EXPECT_FLOAT_EQ(v[e], 0.125f * scale * (q[k] - 32)) << "element " << e;
      }
    }
  }
  // By hand: element 0: ql[0] = 7, qh[0] = 1 -> bits 0-1 = 1 -> q = 7 | 16 = 23; scale -8:
  // 0.125 * -8 * (23 - 32) = 9.
  EXPECT_FLOAT_EQ(v[0], 9.0f);
}

std::vector<float> random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = scale * (2.0f * rng.uniform() - 1.0f);
  return v;
}

TEST(KQuantBlocks, EncodersRoundTripWithinAStep) {
  const std::size_t n = 1024;
  const std::vector<float> x = random_values(n, 7, 0.3f);
  struct Case {
    TensorType type;
    double max_err;  // relative to max|x| = 0.3: about one code step of the format, with slack
  };
  for (const Case c : {Case{TensorType::q8_0, 0.3 / 127}, Case{TensorType::q4_0, 0.3 / 8 * 1.05},
                       Case{TensorType::q4_k, 0.6 / 15 * 0.6}, Case{TensorType::q5_k, 0.6 / 31 * 0.6},
                       Case{TensorType::q6_k, 0.3 / 32 * 1.1}}) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(c.type)));
    std::vector<std::byte> blocks(n / gguf::block_elements(c.type) * gguf::block_bytes(c.type));
    switch (c.type) {
      case TensorType::q8_0: gguf::quantize_q8_0(x.data(), blocks.data(), n); break;
      case TensorType::q4_0: gguf::quantize_q4_0(x.data(), blocks.data(), n); break;
      case TensorType::q4_k: gguf::quantize_q4_k(x.data(), blocks.data(), n); break;
      case TensorType::q5_k: gguf::quantize_q5_k(x.data(), blocks.data(), n); break;
      case TensorType::q6_k: gguf::quantize_q6_k(x.data(), blocks.data(), n); break;
      default: break;
    }
    std::vector<float> back(n);
    gguf::to_float(blocks.data(), c.type, back.data(), n);
    double err = 0;
    for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(static_cast<double>(back[i]) - x[i]));
    EXPECT_LT(err, c.max_err);
    EXPECT_GT(err, 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels on every target.

WeightType weight_type_of(TensorType t) {
  switch (t) {
    case TensorType::q8_0: return WeightType::q8_0;
    case TensorType::q4_0: return WeightType::q4_0;
    case TensorType::q4_k: return WeightType::q4_k;
    case TensorType::q5_k: return WeightType::q5_k;
    case TensorType::q6_k: return WeightType::q6_k;
    default: return WeightType::f32;
  }
}

// Random blocks: every code byte random (all code patterns), scales set to sane fp16 values.
std::vector<std::uint8_t> random_blocks(TensorType t, std::size_t rows, std::size_t cols, std::uint64_t seed) {
  Rng rng(seed);
  const std::size_t bb = gguf::block_bytes(t), per_row = cols / gguf::block_elements(t);
  std::vector<std::uint8_t> b(rows * per_row * bb);
  for (auto& byte : b) byte = static_cast<std::uint8_t>(rng.next() & 0xff);
  for (std::size_t k = 0; k < rows * per_row; ++k) {
    std::uint8_t* blk = b.data() + k * bb;
    const float d = 0.01f + 0.02f * rng.uniform();
    switch (t) {
      case TensorType::q8_0: case TensorType::q4_0: put_half(blk, rng.uniform() < 0.5 ? d : -d); break;
      case TensorType::q4_k: case TensorType::q5_k:
        put_half(blk, d * 0.1f);
        put_half(blk + 2, d * 0.05f);
        break;
      case TensorType::q6_k: put_half(blk + 208, d * 0.05f); break;
      default: break;
    }
  }
  return b;
}

constexpr TensorType kBlockTypes[] = {TensorType::q8_0, TensorType::q4_0, TensorType::q4_k, TensorType::q5_k,
                                      TensorType::q6_k};

TEST(QuantGemv, EveryTargetMatchesDoubleReferenceOverDequantizedBlocks) {
  const std::size_t rows = 37;  // odd row count: tails of the row loop and the split
  for (const TensorType t : kBlockTypes) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(t)));
    // 29 blocks of 32 (the wide kernels take 8 at a time, Q4_0's then 4: tails of 4 and 1) or 3
    // super-blocks of 256.
    const std::size_t cols = gguf::block_elements(t) == 32 ? 928 : 768;
    const std::vector<float> x = random_values(cols, 3);
    qgemv::Q8Blocks xq;
    qgemv::quantize_activation(x.data(), cols, xq);
    for (std::size_t i = 0; i < cols; ++i) ASSERT_LE(std::abs(static_cast<int>(xq.q[i])), 127);
    const std::vector<std::uint8_t> w = random_blocks(t, rows, cols, 11 + static_cast<int>(t));
    const std::size_t row_bytes = w.size() / rows;
    const std::vector<float> wf = decode(t, w, rows * cols);
    // References: against x as the kernel sees it (its int8 blocks), and against x itself.
    std::vector<double> ref_q(rows), ref_x(rows);
    double scale = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = 0; c < cols; ++c) {
        const double xd = static_cast<double>(xq.q[c]) * xq.d[c / 32];
        ref_q[r] += static_cast<double>(wf[r * cols + c]) * xd;
        ref_x[r] += static_cast<double>(wf[r * cols + c]) * x[c];
        scale = std::max(scale, std::fabs(static_cast<double>(wf[r * cols + c])));
      }
    }
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> y(rows, -1.0f);
      qgemv::gemv_rows(weight_type_of(t), w.data(), row_bytes, cols, xq, y.data(), 0, rows);
      for (std::size_t r = 0; r < rows; ++r) {
        // fp32 accumulation of per-block products: rounding ~ 1e-6 of the sum of magnitudes.
        EXPECT_NEAR(y[r], ref_q[r], 2e-5 * scale * static_cast<double>(cols)) << "row " << r;
        // The activation's int8 rounding: |error| <= sum |w| * d/2 per block.
        EXPECT_NEAR(y[r], ref_x[r], 0.01 * scale * static_cast<double>(cols)) << "row " << r;
      }
      // A sub-range touches only its rows.
      std::vector<float> part(rows, -7.0f);
      qgemv::gemv_rows(weight_type_of(t), w.data(), row_bytes, cols, xq, part.data(), 5, 9);
      for (std::size_t r = 0; r < rows; ++r) {
        if (r >= 5 && r < 9) {
          EXPECT_NEAR(part[r], y[r], 1e-6 * scale * static_cast<double>(cols));
        } else {
          EXPECT_EQ(part[r], -7.0f);
        }
      }
    });
  }
}

// Every row range [r0, r1) gives each row the value it has in the whole matrix's product, bit for
// bit, in each activation format: a row's sum never depends on how the rows are split (the pool's
// parts, gemv_multi's shares of several matrices).
TEST(QuantGemv, EveryTargetGivesARowTheSameValueInAnyRowRange) {
  const std::size_t rows = 13;
  for (const TensorType t : kBlockTypes) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(t)));
    const std::size_t cols = gguf::block_elements(t) == 32 ? 928 : 768;
    const std::vector<std::uint8_t> w = random_blocks(t, rows, cols, 5 + static_cast<int>(t));
    const std::size_t row_bytes = w.size() / rows;
    const std::vector<float> x = random_values(cols, 9);
    for (const qgemv::ActivationFormat format :
         {qgemv::ActivationFormat::fine, qgemv::ActivationFormat::q8_0, qgemv::ActivationFormat::q8_k}) {
      qgemv::Q8Blocks xq;
      qgemv::quantize_activation(x.data(), cols, xq, format);
      kvslim::testing::for_each_target([&] {
        SCOPED_TRACE(qgemv::target_name());
        std::vector<float> all(rows);
        qgemv::gemv_rows(weight_type_of(t), w.data(), row_bytes, cols, xq, all.data(), 0, rows);
        for (std::size_t r0 = 0; r0 < rows; ++r0) {
          for (std::size_t r1 = r0 + 1; r1 <= std::min(rows, r0 + 6); ++r1) {
            std::vector<float> part(rows, -3.0f);
            qgemv::gemv_rows(weight_type_of(t), w.data(), row_bytes, cols, xq, part.data(), r0, r1);
            for (std::size_t r = 0; r < rows; ++r) {
              EXPECT_EQ(part[r], r >= r0 && r < r1 ? all[r] : -3.0f) << "range " << r0 << ".." << r1 << ", row " << r;
            }
          }
        }
      });
    }
  }
}

// Decode's fused products (ops.h gemv_multi): one quantized activation and one pool hand-off for
// several matrices give each of them exactly gemv's values; matrices of different activation
// formats or plain float types fall back to one gemv each.
TEST(QuantGemv, GemvMultiMatchesOneGemvPerMatrix) {
  const std::size_t cols = 512;
  const std::vector<float> x = random_values(cols, 77);
  ThreadPool pool(2);
  const std::vector<std::vector<TensorType>> groups = {
      {TensorType::q4_k, TensorType::q4_k, TensorType::q6_k},  // Q4_K_M's q / k / v
      {TensorType::q4_0, TensorType::q4_0, TensorType::q4_0},
      {TensorType::q8_0, TensorType::q8_0},
      {TensorType::q4_0, TensorType::q4_k},  // two activation formats: one gemv each
  };
  const std::size_t row_counts[3] = {1029, 256, 77};
  for (const auto& group : groups) {
    std::vector<std::vector<std::uint8_t>> blocks;
    std::vector<Matrix> mats;
    for (std::size_t k = 0; k < group.size(); ++k) {
      blocks.push_back(random_blocks(group[k], row_counts[k], cols, 50 + k));
    }
    for (std::size_t k = 0; k < group.size(); ++k) {
      mats.push_back(Matrix{weight_type_of(group[k]), blocks[k].data(), row_counts[k], cols});
    }
    std::vector<const Matrix*> ws;
    std::vector<std::vector<float>> fused(group.size()), single(group.size());
    std::vector<float*> ys;
    for (std::size_t k = 0; k < group.size(); ++k) {
      ws.push_back(&mats[k]);
      fused[k].assign(row_counts[k], -1.0f);
      single[k].assign(row_counts[k], -2.0f);
      ys.push_back(fused[k].data());
      gemv(mats[k], x.data(), single[k].data(), &pool);
    }
    gemv_multi(ws.data(), ys.data(), ws.size(), x.data(), &pool);
    for (std::size_t k = 0; k < group.size(); ++k) {
      for (std::size_t r = 0; r < row_counts[k]; ++r) EXPECT_EQ(fused[k][r], single[k][r]) << "matrix " << k << " row " << r;
    }
    std::vector<std::vector<float>> alone(group.size());
    std::vector<float*> ys_alone;
    for (std::size_t k = 0; k < group.size(); ++k) {
      alone[k].assign(row_counts[k], -4.0f);
      ys_alone.push_back(alone[k].data());
    }
    gemv_multi(ws.data(), ys_alone.data(), ws.size(), x.data(), nullptr);  // no pool: one gemv each
    for (std::size_t k = 0; k < group.size(); ++k) EXPECT_EQ(alone[k], single[k]) << "matrix " << k;
  }
}

TEST(QuantGemv, EveryTargetGemmMatchesGemvPerToken) {
  const std::size_t rows = 45, n = 7;  // a partial 16-row tile; 4 + 3 tokens
  for (const TensorType t : kBlockTypes) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(t)));
    const std::size_t cols = gguf::block_elements(t) == 32 ? 800 : 768;
    const std::vector<std::uint8_t> w = random_blocks(t, rows, cols, 31);
    const std::size_t row_bytes = w.size() / rows;
    const std::vector<float> wf = decode(t, w, rows * cols);
    std::vector<qgemv::Q8Blocks> xs(n);
    for (std::size_t s = 0; s < n; ++s) {
      const std::vector<float> x = random_values(cols, 40 + s);
      qgemv::quantize_activation(x.data(), cols, xs[s]);
    }
    double scale = 0;
    const std::vector<double> ref = reference_products(wf, xs, rows, cols, scale);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> y(n * rows, -5.0f);
      qgemv::gemm_rows(weight_type_of(t), w.data(), row_bytes, cols, xs.data(), n, y.data(), rows, 0, rows);
      for (std::size_t i = 0; i < n * rows; ++i) EXPECT_NEAR(y[i], ref[i], 2e-5 * scale * static_cast<double>(cols)) << i;
      // A row range leaves the others alone.
      std::vector<float> part(n * rows, -5.0f);
      qgemv::gemm_rows(weight_type_of(t), w.data(), row_bytes, cols, xs.data(), n, part.data(), rows, 16, 37);
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t r = 0; r < rows; ++r) {
          if (r >= 16 && r < 37) {
            EXPECT_NEAR(part[s * rows + r], y[s * rows + r], 1e-6 * scale * static_cast<double>(cols));
          } else {
            EXPECT_EQ(part[s * rows + r], -5.0f);
          }
        }
      }
    });
  }
}

TEST(QuantGemv, EveryTargetDequantizesAsTheFormat) {
  const std::size_t n = 1024;
  for (const TensorType t : kBlockTypes) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(t)));
    const std::vector<std::uint8_t> w = random_blocks(t, 1, n, 5);
    const std::vector<float> ref = decode(t, w, n);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> out(n, 99.0f);
      qgemv::dequantize(weight_type_of(t), w.data(), out.data(), n);
      // One rounding may be fused (d * q - m as an FMA): equal within an ulp of the terms.
      for (std::size_t i = 0; i < n; ++i) EXPECT_NEAR(out[i], ref[i], 2e-7 * (1.0 + std::fabs(ref[i]))) << i;
    });
  }
}

TEST(QuantGemv, LlamaCppActivationFormats) {
  const std::vector<float> x = random_values(512, 77, 3.0f);
  qgemv::Q8Blocks q0, qk, fine;
  qgemv::quantize_activation(x.data(), 512, q0, qgemv::ActivationFormat::q8_0);
  qgemv::quantize_activation(x.data(), 512, qk, qgemv::ActivationFormat::q8_k);
  qgemv::quantize_activation(x.data(), 512, fine);
  EXPECT_EQ(qgemv::activation_format(WeightType::q4_0), qgemv::ActivationFormat::q8_0);
  EXPECT_EQ(qgemv::activation_format(WeightType::q6_k), qgemv::ActivationFormat::q8_k);
  for (std::size_t b = 0; b < 16; ++b) {
    // q8_0: the scale is an fp16 value; q8_K: one scale per 256 values (signed: -max / 127).
    EXPECT_EQ(q0.d[b], fp16_to_f32(f32_to_fp16(q0.d[b])));
    EXPECT_EQ(qk.d[b], qk.d[b / 8 * 8]);
    for (std::size_t j = 0; j < 32; ++j) {
      const std::size_t i = 32 * b + j;
      EXPECT_LE(std::abs(q0.q[i]), 127);
      EXPECT_LE(std::abs(qk.q[i]), 127);
      EXPECT_NEAR(q0.q[i] * q0.d[b], x[i], std::fabs(q0.d[b]) * 0.51 + 1e-3 * std::fabs(x[i]));
      EXPECT_NEAR(qk.q[i] * qk.d[b], x[i], std::fabs(qk.d[b]) * 0.51);
      EXPECT_NEAR(fine.q[i] * fine.d[b], x[i], fine.d[b] * 0.51);
    }
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < 16; ++j) sum += qk.q[32 * b + j];
    EXPECT_EQ(qk.s16[2 * b], sum);
    EXPECT_FLOAT_EQ(qk.ds[b], qk.d[b] * static_cast<float>(qk.s16[2 * b] + qk.s16[2 * b + 1]));
  }
}

TEST(QuantGemv, EveryTargetQuantizesTheActivationAsTheScalarReference) {
  // SIMD codes, scales and sums bit-identical to the scalar loop, in every format; values at
  // exact .5 code steps (ties to even), a zero block and a block whose largest magnitude is negative.
  const std::size_t n = 1024;
  std::vector<float> x = random_values(n, 91, 2.0f);
  for (std::size_t i = 64; i < 96; ++i) x[i] = 0.0f;
  for (std::size_t i = 96; i < 128; ++i) x[i] = static_cast<float>(static_cast<int>(i) - 112) * 0.5f;
  x[300] = -9.0f;
  for (const auto format : {qgemv::ActivationFormat::fine, qgemv::ActivationFormat::q8_0, qgemv::ActivationFormat::q8_k}) {
    qgemv::Q8Blocks ref;
    qgemv::quantize_activation_reference(x.data(), n, ref, format);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      qgemv::Q8Blocks q;
      qgemv::quantize_activation(x.data(), n, q, format);
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(q.q[i], ref.q[i]) << i;
      for (std::size_t b = 0; b < n / 32; ++b) {
        ASSERT_EQ(q.d[b], ref.d[b]) << b;
        ASSERT_EQ(q.ds[b], ref.ds[b]) << b;
      }
      for (std::size_t u = 0; u < n / 16; ++u) ASSERT_EQ(q.s16[u], ref.s16[u]) << u;
      // The kernels' rearranged copies.
      for (std::size_t g = 0; g < n / 128; ++g) {
        for (std::size_t k = 0; k < 4; ++k) {
          for (std::size_t j = 0; j < 16; ++j) {
            ASSERT_EQ(q.q_nib0[128 * g + 16 * k + j], q.q[128 * g + 32 * k + j]);
            ASSERT_EQ(q.q_nib0[128 * g + 64 + 16 * k + j], q.q[128 * g + 32 * k + 16 + j]);
          }
        }
      }
      const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
      for (std::size_t i = 0; i < n / 256; ++i) {
        for (int k = 0; k < 8; ++k) {
          for (int j = 0; j < 32; ++j) ASSERT_EQ(q.q_nibk[256 * i + 32 * k + j], q.q[256 * i + 32 * order[k] + j]);
        }
      }
    });
  }
}

TEST(QuantGemv, ZeroScalesAndZeroActivationGiveZero) {
  const std::size_t cols = 256;
  std::vector<float> x(cols, 0.0f);
  qgemv::Q8Blocks xq;
  qgemv::quantize_activation(x.data(), cols, xq);
  for (const TensorType t : kBlockTypes) {
    const std::vector<std::uint8_t> w = random_blocks(t, 3, cols, 9);
    kvslim::testing::for_each_target([&] {
      std::vector<float> y(3, 1.0f);
      qgemv::gemv_rows(weight_type_of(t), w.data(), w.size() / 3, cols, xq, y.data(), 0, 3);
      for (float v : y) EXPECT_EQ(v, 0.0f);
    });
  }
}

TEST(QuantGemv, MatrixGemvWithPoolAndMatmulMatchTheReference) {
  const std::size_t rows = 1029, cols = 512;  // large enough for the pool's split
  const std::vector<float> x = random_values(cols * 4, 21);
  ThreadPool pool(2);
  for (const TensorType t : kBlockTypes) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(t)));
    const std::vector<std::uint8_t> w = random_blocks(t, rows, cols, 17);
    const std::vector<float> wf = decode(t, w, rows * cols);
    const Matrix m{weight_type_of(t), w.data(), rows, cols};
    ASSERT_EQ(m.nbytes(), w.size());
    std::vector<float> y1(rows), y2(rows), ymm(4 * rows);
    gemv(m, x.data(), y1.data(), nullptr);
    gemv(m, x.data(), y2.data(), &pool);
    std::vector<float> tile(64 * cols);
    matmul(m, x.data(), 4, ymm.data(), tile.data(), 64, &pool);  // prefill: dequantized tiles + sgemm
    for (std::size_t r = 0; r < rows; ++r) {
      double ref = 0, mag = 0;
      for (std::size_t c = 0; c < cols; ++c) {
        ref += static_cast<double>(wf[r * cols + c]) * x[c];
        mag += std::fabs(static_cast<double>(wf[r * cols + c]));
      }
      EXPECT_NEAR(y1[r], ref, mag / 254 + 1e-4) << r;  // x in [-1, 1]: activation step <= 1/127
      EXPECT_EQ(y1[r], y2[r]) << r;  // the split does not change a row's sum
      // Prefill: int8 products on AVX-512 VNNI (the activation's rounding), else fp32 sgemm.
      EXPECT_NEAR(ymm[r], ref, mag / 254 + 1e-4) << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Interleaved types: Q4_0 / Q4_K matrices repacked at load into Q4_0x16 / Q4_Kx16 (16 rows side by
// side, quant_gemv.h interleave).

std::vector<std::uint8_t> interleaved(const std::vector<std::uint8_t>& w, std::size_t rows, std::size_t cols,
                                      WeightType type = WeightType::q4_0) {
  const std::size_t row_bytes = w.size() / rows;
  std::vector<const std::uint8_t*> src(rows);
  for (std::size_t r = 0; r < rows; ++r) src[r] = w.data() + r * row_bytes;
  std::vector<std::uint8_t> out(rows * weight_bytes(qgemv::interleaved_type(type), cols), 0xee);
  qgemv::interleave(type, src.data(), rows, cols, out.data());
  return out;
}

// Each file type with an interleaved form, the activation format its kernels take, and a column
// count with an odd number of blocks (the AVX-512 decode kernels take blocks in pairs).
struct InterleavedCase {
  TensorType file;
  WeightType type;
  std::size_t cols;
  qgemv::ActivationFormat format;
};
constexpr InterleavedCase kInterleaved[] = {
    {TensorType::q4_0, WeightType::q4_0x16, 928, qgemv::ActivationFormat::q8_0},  // 29 blocks
    {TensorType::q4_k, WeightType::q4_kx16, 768, qgemv::ActivationFormat::q8_k},  // 3 super-blocks
    {TensorType::q6_k, WeightType::q6_kx16, 768, qgemv::ActivationFormat::q8_k},
};

TEST(QuantGemvInterleaved, HoldTheRowsAndDecodeToThem) {
  const std::size_t rows = 32;
  for (const InterleavedCase& k : kInterleaved) {
    SCOPED_TRACE(weight_type_name(k.type));
    const WeightType base = weight_type_of(k.file);
    EXPECT_EQ(qgemv::interleaved_type(base), k.type);
    const std::vector<std::uint8_t> w = random_blocks(k.file, rows, k.cols, 3);
    const std::vector<std::uint8_t> wi = interleaved(w, rows, k.cols, base);
    const std::size_t row_bytes = w.size() / rows;
    if (k.type == WeightType::q4_0x16) {
      std::multiset<std::uint8_t> a(w.begin(), w.end()), b(wi.begin(), wi.end());
      EXPECT_EQ(a, b);  // Q4_0x16: a permutation of the bytes (every one written)
    } else if (k.type == WeightType::q6_kx16) {
      EXPECT_EQ(wi.size(), w.size());  // Q6_K's bytes, the codes regrouped
      // Every byte written: the same groups out of buffers filled with 0x00 and with 0xff.
      std::vector<const std::uint8_t*> src(rows);
      for (std::size_t r = 0; r < rows; ++r) src[r] = w.data() + r * row_bytes;
      std::vector<std::uint8_t> w0(wi.size(), 0x00), w1(wi.size(), 0xff);
      qgemv::interleave(base, src.data(), rows, k.cols, w0.data());
      qgemv::interleave(base, src.data(), rows, k.cols, w1.data());
      EXPECT_EQ(w0, w1);
      EXPECT_EQ(w0, wi);
    } else {
      EXPECT_EQ(wi.size(), rows * k.cols / 256 * 148);  // Q4_K's 144 bytes with the 12 scale bytes unpacked to 16
    }
    // Every row comes back as its file blocks, bit for bit (random scale bytes: every 6-bit packing).
    std::vector<std::uint8_t> back_row(row_bytes);
    for (std::size_t r = 0; r < rows; ++r) {
      qgemv::deinterleave_row(k.type, wi.data(), k.cols, r, back_row.data());
      ASSERT_TRUE(std::equal(back_row.begin(), back_row.end(), w.begin() + static_cast<std::ptrdiff_t>(r * row_bytes))) << "row " << r;
    }
    const std::vector<float> wf = decode(k.file, w, rows * k.cols);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> back(rows * k.cols, 9.0f);
      qgemv::dequantize_rows(k.type, wi.data(), k.cols, 0, rows, back.data());
      EXPECT_EQ(back, wf);
      std::vector<float> part(7 * k.cols);
      qgemv::dequantize_rows(k.type, wi.data(), k.cols, 13, 7, part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), wf.begin() + static_cast<std::ptrdiff_t>(13 * k.cols)));
    });
    std::vector<float> out(k.cols);
    EXPECT_THROW(qgemv::dequantize(k.type, wi.data(), out.data(), k.cols), std::invalid_argument);
    std::vector<const std::uint8_t*> src(rows, w.data());
    std::vector<std::uint8_t> sink(wi.size());
    EXPECT_THROW(qgemv::interleave(base, src.data(), 24, k.cols, sink.data()), std::invalid_argument);  // not 16-row groups
    EXPECT_THROW(qgemv::interleave(base, src.data(), rows, k.cols + 16, sink.data()), std::invalid_argument);  // part block
    EXPECT_THROW(qgemv::deinterleave_row(base, w.data(), k.cols, 0, back_row.data()), std::invalid_argument);
  }
  std::vector<const std::uint8_t*> src(16, nullptr);
  EXPECT_EQ(qgemv::interleaved_type(WeightType::q5_k), WeightType::q5_k);  // no interleaved form
  EXPECT_THROW(qgemv::interleave(WeightType::q5_k, src.data(), 16, 256, nullptr), std::invalid_argument);
}

// Q6_Kx16's code bytes as quant_gemv.h documents them: per half h and chunk c, X0..X2 = [row][4
// bytes], byte k of Xj = the code of value 128h + 32j + 4c + k | bits 2j, 2j+1 of the code of value
// 128h + 96 + 4c + k in bits 6-7; codes packed into Q6_K blocks by hand (ql / qh as ggml writes them).
TEST(QuantGemvInterleaved, Q6_Kx16CodeBytesAsDocumented) {
  const std::size_t rows = 16, cols = 512;
  auto code = [](std::size_t r, std::size_t v) { return static_cast<int>((v * 7 + r * 13 + v / 64) % 64); };
  std::vector<std::uint8_t> w(rows * cols / 256 * 210, 0);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t i = 0; i < cols / 256; ++i) {
      std::uint8_t* blk = w.data() + 210 * (r * cols / 256 + i);
      for (int g = 0; g < 16; ++g) blk[192 + g] = static_cast<std::uint8_t>(g + 1);
      put_half(blk + 208, 0.5f);
      for (std::size_t v = 0; v < 256; ++v) {
        const int q = code(r, 256 * i + v), h = static_cast<int>(v / 128), t = static_cast<int>(v % 128 / 32), l = static_cast<int>(v % 32);
        blk[64 * h + 32 * (t % 2) + l] |= static_cast<std::uint8_t>((q & 15) << (t < 2 ? 0 : 4));
        blk[128 + 32 * h + l] |= static_cast<std::uint8_t>((q >> 4) << (2 * t));
      }
    }
  }
  const std::vector<std::uint8_t> wi = interleaved(w, rows, cols, WeightType::q6_k);
  ASSERT_EQ(wi.size(), w.size());
  for (std::size_t i = 0; i < cols / 256; ++i) {
    const std::uint8_t* u = wi.data() + 3360 * i;
    for (std::size_t r = 0; r < rows; ++r) {
      float d = 0;
      gguf::to_float(reinterpret_cast<const std::byte*>(u + 2 * r), TensorType::f16, &d, 1);
      EXPECT_EQ(d, 0.5f);
      for (int g = 0; g < 16; ++g) EXPECT_EQ(u[32 + 16 * g + r], g + 1);
      for (int h = 0; h < 2; ++h) {
        for (int c = 0; c < 8; ++c) {
          for (int j = 0; j < 3; ++j) {
            for (int k = 0; k < 4; ++k) {
              const std::size_t v = 256 * i + 128 * h + 4 * c + k;
              const int expect = code(r, v + 32 * j) | (((code(r, v + 96) >> (2 * j)) & 3) << 6);
              ASSERT_EQ(u[288 + 1536 * h + 192 * c + 64 * j + 4 * r + k], expect) << "unit " << i << " row " << r << " h " << h << " c " << c << " X" << j;
            }
          }
        }
      }
    }
  }
}

TEST(QuantGemvInterleaved, EveryTargetMatchesTheReferenceInAnyRowRange) {
  const std::size_t rows = 48;
  for (const InterleavedCase& k : kInterleaved) {
    SCOPED_TRACE(weight_type_name(k.type));
    const std::size_t cols = k.cols;
    const std::vector<std::uint8_t> w = random_blocks(k.file, rows, cols, 21);
    const std::vector<std::uint8_t> wi = interleaved(w, rows, cols, weight_type_of(k.file));
    const std::vector<float> wf = decode(k.file, w, rows * cols);
    const std::vector<float> x = random_values(cols, 8);
    for (const qgemv::ActivationFormat format :
         {qgemv::ActivationFormat::fine, qgemv::ActivationFormat::q8_0, qgemv::ActivationFormat::q8_k}) {
      qgemv::Q8Blocks xq;
      qgemv::quantize_activation(x.data(), cols, xq, format);
      std::vector<float> all(rows, -1.0f);
      if (k.format == qgemv::ActivationFormat::q8_k && format != qgemv::ActivationFormat::q8_k) {
        // Its kernels sum a super-block's sub-blocks in int32 under one activation scale.
        EXPECT_THROW(qgemv::gemv_rows(k.type, wi.data(), 0, cols, xq, all.data(), 0, rows), std::invalid_argument);
        EXPECT_THROW(qgemv::gemm_rows(k.type, wi.data(), 0, cols, &xq, 1, all.data(), rows, 0, rows), std::invalid_argument);
        continue;
      }
      std::vector<double> ref(rows);
      double scale = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t c = 0; c < cols; ++c) {
          ref[r] += static_cast<double>(wf[r * cols + c]) * xq.q[c] * xq.d[c / 32];
          scale = std::max(scale, std::fabs(static_cast<double>(wf[r * cols + c])));
        }
      }
      kvslim::testing::for_each_target([&] {
        SCOPED_TRACE(qgemv::target_name());
        std::vector<float> plain(rows);
        qgemv::gemv_rows(k.type, wi.data(), 0, cols, xq, all.data(), 0, rows);
        qgemv::gemv_rows(weight_type_of(k.file), w.data(), w.size() / rows, cols, xq, plain.data(), 0, rows);
        for (std::size_t r = 0; r < rows; ++r) {
          EXPECT_NEAR(all[r], ref[r], 2e-5 * scale * static_cast<double>(cols)) << "row " << r;
          EXPECT_NEAR(all[r], plain[r], 2e-5 * scale * static_cast<double>(cols)) << "row " << r;
        }
        for (const std::size_t r0 : {0, 3, 15, 16, 17, 31, 40}) {
          for (const std::size_t r1 : {r0 + 1, r0 + 5, std::size_t{32}, rows}) {
            if (r1 <= r0 || r1 > rows) continue;
            std::vector<float> part(rows, -3.0f);
            qgemv::gemv_rows(k.type, wi.data(), 0, cols, xq, part.data(), r0, r1);
            for (std::size_t r = 0; r < rows; ++r) {
              EXPECT_EQ(part[r], r >= r0 && r < r1 ? all[r] : -3.0f) << "range " << r0 << ".." << r1 << ", row " << r;
            }
          }
        }
      });
    }
  }
}

// The K-quant forms' integer sums at their extremes: Q4_Kx16 every code 15 with the largest 6-bit
// scales and mins; Q6_Kx16 every code 63 (and 0) with scales -128 / 127; an activation of +-127
// codes (int32 sums near 2^25 / 2^28), against the double reference on every target.
TEST(QuantGemvInterleaved, KQuantExtremeCodesStayExact) {
  const std::size_t rows = 16, cols = 512;
  std::vector<float> x(cols);
  for (std::size_t c = 0; c < cols; ++c) x[c] = c % 5 == 0 ? -1.0f : 1.0f;
  qgemv::Q8Blocks xq;
  qgemv::quantize_activation(x.data(), cols, xq, qgemv::ActivationFormat::q8_k);
  for (const TensorType file : {TensorType::q4_k, TensorType::q6_k}) {
    SCOPED_TRACE(gguf::tensor_type_name(static_cast<std::uint32_t>(file)));
    const std::size_t bb = gguf::block_bytes(file);
    std::vector<std::uint8_t> w(rows * cols / 256 * bb, 0xff);  // Q4_K: codes 15, scale bytes all ones (63s)
    for (std::size_t k = 0; k < rows * cols / 256; ++k) {
      std::uint8_t* blk = w.data() + bb * k;
      if (file == TensorType::q4_k) {
        put_half(blk, 1e-3f);
        put_half(blk + 2, 2e-3f);
      } else {
        // Codes 63 in the first half, 0 (-32) in the second; scales alternating -128 and 127.
        std::memset(blk + 64, 0, 64);
        std::memset(blk + 160, 0, 32);
        for (int g = 0; g < 16; ++g) blk[192 + g] = g % 2 == 0 ? 0x80 : 0x7f;
        put_half(blk + 208, 1e-3f);
      }
    }
    const std::vector<std::uint8_t> wi = interleaved(w, rows, cols, weight_type_of(file));
    const std::vector<float> wf = decode(file, w, rows * cols);
    double ref = 0;
    for (std::size_t c = 0; c < cols; ++c) ref += static_cast<double>(wf[c]) * xq.q[c] * xq.d[c / 32];
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> y(rows);
      qgemv::gemv_rows(qgemv::interleaved_type(weight_type_of(file)), wi.data(), 0, cols, xq, y.data(), 0, rows);
      for (std::size_t r = 0; r < rows; ++r) EXPECT_NEAR(y[r], ref, 1e-6 * std::fabs(ref)) << r;
    });
  }
}

TEST(QuantGemvInterleaved, EveryTargetGemmMatchesTheReference) {
  const std::size_t rows = 48, n = 7;  // 4 + 3 tokens
  for (const InterleavedCase& k : kInterleaved) {
    SCOPED_TRACE(weight_type_name(k.type));
    const std::size_t cols = k.type == WeightType::q4_0x16 ? 800 : 768;  // 25 blocks; 3 super-blocks
    const std::vector<std::uint8_t> w = random_blocks(k.file, rows, cols, 31);
    const std::vector<std::uint8_t> wi = interleaved(w, rows, cols, weight_type_of(k.file));
    const std::vector<float> wf = decode(k.file, w, rows * cols);
    std::vector<qgemv::Q8Blocks> xs(n);
    for (std::size_t s = 0; s < n; ++s) {
      const std::vector<float> x = random_values(cols, 40 + s);
      qgemv::quantize_activation(x.data(), cols, xs[s], k.format);
    }
    double scale = 0;
    const std::vector<double> ref = reference_products(wf, xs, rows, cols, scale);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<float> y(n * rows, -5.0f);
      qgemv::gemm_rows(k.type, wi.data(), 0, cols, xs.data(), n, y.data(), rows, 0, rows);
      for (std::size_t i = 0; i < n * rows; ++i) EXPECT_NEAR(y[i], ref[i], 2e-5 * scale * static_cast<double>(cols)) << i;
      std::vector<float> part(n * rows, -5.0f);
      qgemv::gemm_rows(k.type, wi.data(), 0, cols, xs.data(), n, part.data(), rows, 5, 37);
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t r = 0; r < rows; ++r) {
          EXPECT_EQ(part[s * rows + r], r >= 5 && r < 37 ? y[s * rows + r] : -5.0f) << "token " << s << " row " << r;
        }
      }
    });
  }
}

// The ops.h entry points (pool split, gemv_multi, matmul's int8 tiles or dequantized tiles + sgemm,
// convert_rows) on interleaved matrices, on every target; for Q4_Kx16 the fused product also takes
// a Q6_K matrix beside it (Q4_K_M's q/k/v: the same q8_k activation).
TEST(QuantGemvInterleaved, MatrixOpsOnEveryTarget) {
  const std::size_t cols = 512;
  const std::size_t row_counts[3] = {1024, 256, 272};
  for (const InterleavedCase& k : kInterleaved) {
    SCOPED_TRACE(weight_type_name(k.type));
    std::vector<std::vector<std::uint8_t>> plain, packed;
    std::vector<Matrix> mats;
    std::vector<TensorType> files;
    for (std::size_t m = 0; m < 3; ++m) {
      // Q4_Kx16's third matrix stays Q6_K (not repacked), as Q4_K_M's attn_v.
      const TensorType file = k.type == WeightType::q4_kx16 && m == 2 ? TensorType::q6_k : k.file;
      files.push_back(file);
      plain.push_back(random_blocks(file, row_counts[m], cols, 60 + m));
      packed.push_back(file == k.file ? interleaved(plain[m], row_counts[m], cols, weight_type_of(file)) : plain[m]);
    }
    for (std::size_t m = 0; m < 3; ++m) {
      mats.push_back(Matrix{files[m] == k.file ? k.type : weight_type_of(files[m]), packed[m].data(), row_counts[m], cols});
    }
    const std::vector<float> x = random_values(cols * 4, 21);
    ThreadPool pool(2);
    kvslim::testing::for_each_target([&] {
      SCOPED_TRACE(qgemv::target_name());
      std::vector<std::vector<float>> single(3), fused(3);
      std::vector<float*> ys;
      std::vector<const Matrix*> ws;
      for (std::size_t m = 0; m < 3; ++m) {
        const Matrix& mat = mats[m];
        const std::vector<float> wf = decode(files[m], plain[m], mat.rows * cols);
        std::vector<float> rows_back(mat.rows * cols);
        convert_rows(mat, 0, mat.rows, rows_back.data());
        EXPECT_EQ(rows_back, wf);
        std::vector<float> y1(mat.rows), ymm(4 * mat.rows), tile(64 * cols);
        single[m].assign(mat.rows, 0.0f);
        gemv(mat, x.data(), y1.data(), nullptr);
        gemv(mat, x.data(), single[m].data(), &pool);
        EXPECT_EQ(y1, single[m]);
        matmul(mat, x.data(), 4, ymm.data(), tile.data(), 64, &pool);
        for (std::size_t s = 0; s < 4; ++s) {
          for (std::size_t r = 0; r < mat.rows; ++r) {
            double ref = 0, mag = 0;
            for (std::size_t c = 0; c < cols; ++c) {
              ref += static_cast<double>(wf[r * cols + c]) * x[s * cols + c];
              mag += std::fabs(static_cast<double>(wf[r * cols + c]));
            }
            if (s == 0) {
              EXPECT_NEAR(y1[r], ref, mag / 254 + 1e-4) << r;
            }
            EXPECT_NEAR(ymm[s * mat.rows + r], ref, mag / 254 + 1e-4) << "token " << s << " row " << r;
          }
        }
        fused[m].assign(mat.rows, -1.0f);
        ys.push_back(fused[m].data());
        ws.push_back(&mat);
      }
      gemv_multi(ws.data(), ys.data(), 3, x.data(), &pool);
      for (std::size_t m = 0; m < 3; ++m) EXPECT_EQ(fused[m], single[m]) << "matrix " << m;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Model level: quantized kernels vs the same weights dequantized to fp32.

// The same config and tensors with every weight converted to fp32 (the "dequantized at load" path).
Model dequantized_copy(const Model& q, std::vector<std::vector<float>>& keep) {
  std::vector<TensorInfo> tensors;
  for (const std::string& name : q.store().names()) {
    const TensorInfo& t = *q.store().find(name);
    const std::size_t n = weight_elements(t.type, t.nbytes);
    keep.emplace_back(n);
    convert_tensor(t, keep.back().data());
    TensorInfo f = t;
    f.type = WeightType::f32;
    f.data = keep.back().data();
    f.nbytes = n * 4;
    tensors.push_back(f);
  }
  return Model::from(q.config(), WeightStore::from_tensors(std::move(tensors), nullptr));
}

struct GreedyRun {
  std::vector<int> tokens;
  std::vector<std::vector<float>> logits;
};

// Greedy decoding, or (with `forced`) decoding `forced` whatever the logits say, so that two
// models' logits are compared on the same sequence.
GreedyRun greedy(const Model& m, const std::vector<int>& prompt, int steps, const std::vector<int>* forced = nullptr) {
  CacheSet caches = KVCacheBuilder::for_model(m.cache_spec(), KVCacheConfig{});
  Transformer t(m, caches);
  auto l = t.prefill(prompt);
  GreedyRun run;
  for (int i = 0; i < steps; ++i) {
    run.logits.emplace_back(l.begin(), l.end());
    const int next = static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin());
    run.tokens.push_back(next);
    l = t.decode(forced != nullptr ? (*forced)[i] : next);
  }
  return run;
}

class QuantModel : public ::testing::TestWithParam<TensorType> {};

TEST_P(QuantModel, KeepsBlocksInMemoryAndDecodesLikeTheDequantizedWeights) {
  const TensorType type = GetParam();
  testing::TempDir tmp;
  RandomModelSpec spec;
  spec.hidden_size = 256;
  spec.intermediate_size = 512;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.num_layers = 2;
  spec.vocab_size = 300;
  spec.seed = 5;
  write_random_model(tmp.path() / "hf", spec);
  const Model hf = Model::load(tmp.path() / "hf");
  write_gguf(hf, "", tmp.path() / "m.gguf", {.matrix_type = type});
  const Model q = Model::load(tmp.path() / "m.gguf");

  // Every matrix is held in the file's type (Q4_0 / Q4_K matrices repacked at load into Q4_0x16 /
  // Q4_Kx16: Q4_0's bytes rearranged, Q4_K's with the scales unpacked, 148 bytes per 144; the
  // embedding as stored): the resident bytes are the blocks' bytes (Q4_K: 148 / 144 of them).
  const WeightType wt = weight_type_of(type);
  const WeightType matrices = qgemv::interleaved_type(wt);
  EXPECT_EQ(q.weights().layers[0].wq.type, matrices);
  EXPECT_EQ(q.weights().layers[1].w_down.type, matrices);
  EXPECT_EQ(q.weights().embed.type, wt);
  const std::size_t block_bytes = wt == WeightType::q4_k ? 148 : gguf::block_bytes(type);
  for (const Matrix* m : {&q.weights().layers[0].wq, &q.weights().layers[0].w_up}) {
    EXPECT_EQ(m->nbytes(), m->rows * m->cols / gguf::block_elements(type) * block_bytes);
  }
  EXPECT_LT(q.decode_weight_bytes(), hf.decode_weight_bytes() / 3);

  std::vector<std::vector<float>> keep;
  const Model f = dequantized_copy(q, keep);
  const std::vector<int> prompt = {1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 31};
  const int steps = 12;
  const GreedyRun b = greedy(f, prompt, steps), a = greedy(q, prompt, steps, &b.tokens);
  // The logits differ by the activation's int8 rounding in the products of one token (decode, and
  // the prompt's last-token lm_head); the prompt's other products are the same fp32 sgemm.
  ASSERT_EQ(a.logits.size(), b.logits.size());
  double max_diff = 0, max_logit = 0;
  for (int i = 0; i < steps; ++i) {
    for (std::size_t v = 0; v < a.logits[i].size(); ++v) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(a.logits[i][v]) - b.logits[i][v]));
      max_logit = std::max(max_logit, std::fabs(static_cast<double>(b.logits[i][v])));
    }
  }
  EXPECT_LT(max_diff, 0.02 * max_logit) << "max |logit| " << max_logit;
  std::printf("%s: max |logit difference| %.4g of max |logit| %.4g\n", gguf::tensor_type_name(static_cast<std::uint32_t>(type)).c_str(),
              max_diff, max_logit);
  // The same greedy tokens wherever the dequantized run's top-2 margin exceeds the logits' difference.
  for (int i = 0; i < steps; ++i) {
    std::vector<float> s = b.logits[i];
    std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
    if (s[0] - s[1] > 2 * max_diff) {
      EXPECT_EQ(a.tokens[i], b.tokens[i]) << "step " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantModel,
                         ::testing::Values(TensorType::q8_0, TensorType::q4_0, TensorType::q4_k, TensorType::q5_k,
                                           TensorType::q6_k),
                         [](const auto& info) { return gguf::tensor_type_name(static_cast<std::uint32_t>(info.param)); });

}  // namespace
}  // namespace kvslim::engine
