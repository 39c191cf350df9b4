// Attention over cache views: against a direct double-precision formula, invariance to row order
// (eviction reuses slots), causal masking by position, GQA head mapping, the observation sums,
// and the full-prompt concatenation with its observation remap.
#include "engine/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "engine/sampler.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {
namespace {

// A hand-made view: [H_kv, N, D] fp16 keys/values and [H_kv, N] positions.
struct OwnedView {
  std::vector<std::uint16_t> k, v;
  std::vector<std::int64_t> pos;
  std::size_t heads = 0, tokens = 0, d = 0;
  CacheView view() const {
    CacheView cv;
    cv.batch = 1;
    cv.heads = heads;
    cv.tokens = tokens;
    cv.head_dim = d;
    cv.head_stride = tokens;
    cv.keys = k.data();
    cv.values = v.data();
    cv.positions = pos.data();
    return cv;
  }
};

OwnedView random_view(std::size_t heads, std::size_t tokens, std::size_t d, std::uint64_t seed) {
  Rng rng(seed);
  OwnedView o;
  o.heads = heads, o.tokens = tokens, o.d = d;
  o.k.resize(heads * tokens * d);
  o.v.resize(heads * tokens * d);
  o.pos.resize(heads * tokens);
  for (auto& x : o.k) x = f32_to_fp16(2 * rng.uniform() - 1);
  for (auto& x : o.v) x = f32_to_fp16(2 * rng.uniform() - 1);
  for (std::size_t h = 0; h < heads; ++h) {
    for (std::size_t i = 0; i < tokens; ++i) o.pos[h * tokens + i] = static_cast<std::int64_t>(i);
  }
  return o;
}

// Same rows, each head's rows permuted differently.
OwnedView shuffled(const OwnedView& in, std::uint64_t seed) {
  OwnedView o = in;
  Rng rng(seed);
  for (std::size_t h = 0; h < in.heads; ++h) {
    std::vector<std::size_t> perm(in.tokens);
    std::iota(perm.begin(), perm.end(), 0);
    for (std::size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.next() % i]);
    for (std::size_t i = 0; i < in.tokens; ++i) {
      const std::size_t src = h * in.tokens + perm[i], dst = h * in.tokens + i;
      std::copy_n(in.k.begin() + src * in.d, in.d, o.k.begin() + dst * in.d);
      std::copy_n(in.v.begin() + src * in.d, in.d, o.v.begin() + dst * in.d);
      o.pos[dst] = in.pos[src];
    }
  }
  return o;
}

// Direct formula, in double: out [S, H, D] and group-summed probabilities keyed by position.
void reference(const OwnedView& v, const std::vector<float>& q, const std::vector<std::int64_t>& qpos, int heads,
               std::vector<double>& out) {
  const std::size_t d = v.d, group = heads / v.heads;
  out.assign(qpos.size() * heads * d, 0.0);
  for (std::size_t s = 0; s < qpos.size(); ++s) {
    for (int h = 0; h < heads; ++h) {
      const std::size_t g = h / group;
      std::vector<double> sc(v.tokens, -INFINITY);
      double mx = -INFINITY;
      for (std::size_t i = 0; i < v.tokens; ++i) {
        if (v.pos[g * v.tokens + i] > qpos[s]) continue;
        double dot = 0;
        for (std::size_t j = 0; j < d; ++j) dot += q[(s * heads + h) * d + j] * fp16_to_f32(v.k[(g * v.tokens + i) * d + j]);
        sc[i] = dot / std::sqrt(static_cast<double>(d));
        mx = std::max(mx, sc[i]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (double& x : sc) sum += (x = std::exp(x - mx));
      for (std::size_t i = 0; i < v.tokens; ++i) {
        for (std::size_t j = 0; j < d; ++j) {
          out[(s * heads + h) * d + j] += sc[i] / sum * fp16_to_f32(v.v[(g * v.tokens + i) * d + j]);
        }
      }
    }
  }
}

std::vector<float> random_queries(std::size_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> q(n);
  for (float& x : q) x = 3 * (2 * rng.uniform() - 1);
  return q;
}

// Both code paths: 1 query (fp16 row kernels) and many queries (sgemm over converted rows).
class AttentionPaths : public ::testing::TestWithParam<std::size_t> {};

TEST_P(AttentionPaths, MatchesFormulaWithCausalMaskAndGqa) {
  const int heads = 6, kv_heads = 2, d = 16;
  const std::size_t n_q = GetParam(), tokens = 40;
  const OwnedView v = random_view(kv_heads, tokens, d, 11);
  std::vector<std::int64_t> qpos(n_q);
  for (std::size_t s = 0; s < n_q; ++s) qpos[s] = static_cast<std::int64_t>(tokens - n_q + s);
  const std::vector<float> q = random_queries(n_q * heads * d, 5);
  Attention attn(heads, kv_heads, d, 4, 8);  // deliberately small: scratch must grow
  std::vector<float> out(n_q * heads * d);
  ThreadPool pool(2);
  attn.attend(v.view(), q.data(), qpos, out.data(), nullptr, &pool);
  std::vector<double> ref;
  reference(v, q, qpos, heads, ref);
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5) << i;
}

TEST_P(AttentionPaths, ShuffledViewGivesTheSameOutputAndPermutedObservation) {
  const int heads = 4, kv_heads = 2, d = 8;
  const std::size_t n_q = GetParam(), tokens = 80;
  const OwnedView ordered = random_view(kv_heads, tokens, d, 3);
  const OwnedView mixed = shuffled(ordered, 17);
  std::vector<std::int64_t> qpos(n_q);
  for (std::size_t s = 0; s < n_q; ++s) qpos[s] = static_cast<std::int64_t>(tokens - n_q + s);
  const std::vector<float> q = random_queries(n_q * heads * d, 8);
  Attention attn(heads, kv_heads, d, n_q, tokens);
  std::vector<float> out_a(n_q * heads * d), out_b(out_a.size());
  std::vector<float> obs_a(attn.observation_size(n_q, tokens)), obs_b(obs_a.size());
  attn.attend(ordered.view(), q.data(), qpos, out_a.data(), obs_a.data());
  attn.attend(mixed.view(), q.data(), qpos, out_b.data(), obs_b.data());
  for (std::size_t i = 0; i < out_a.size(); ++i) ASSERT_NEAR(out_a[i], out_b[i], 1e-5);
  // Observation column i belongs to view row i: compare by position.
  for (std::size_t g = 0; g < 2; ++g) {
    for (std::size_t s = 0; s < n_q; ++s) {
      double total = 0;
      for (std::size_t i = 0; i < tokens; ++i) {
        const std::int64_t p = mixed.pos[g * tokens + i];
        EXPECT_NEAR(obs_b[(g * n_q + s) * tokens + i], obs_a[(g * n_q + s) * tokens + p], 1e-6);
        if (p > qpos[s]) {
          EXPECT_EQ(obs_b[(g * n_q + s) * tokens + i], 0.0f) << "future row got attention";
        }
        total += obs_b[(g * n_q + s) * tokens + i];
      }
      EXPECT_NEAR(total, 2.0, 1e-5);  // two query heads per group, each a distribution
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DecodeAndPrefill, AttentionPaths, ::testing::Values(1, 3, 70));

TEST(Attention, OneHotKeysGiveExactAverages) {
  // Query orthogonal to every key: uniform weights, so the output is the mean of visible values.
  const int d = 4;
  OwnedView v = random_view(1, 3, d, 1);
  for (auto& x : v.k) x = 0;
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  for (std::size_t i = 0; i < 12; ++i) v.v[i] = f32_to_fp16(values[i]);
  v.pos = {5, 1, 9};  // rows out of order
  Attention attn(1, 1, d, 1, 3);
  std::vector<float> q = {1, 0, 0, 0}, out(4);
  const std::vector<std::int64_t> qpos = {6};  // sees rows at positions 5 and 1, not 9
  attn.attend(v.view(), q.data(), qpos, out.data(), nullptr);
  for (int j = 0; j < d; ++j) EXPECT_FLOAT_EQ(out[j], (values[j] + values[4 + j]) / 2);
}

TEST(Attention, QueryThatSeesNoRowGetsZeros) {
  OwnedView v = random_view(1, 2, 4, 2);
  v.pos = {10, 11};
  Attention attn(2, 1, 4, 1, 2);
  std::vector<float> q(8, 1.0f), out(8, NAN), obs(attn.observation_size(1, 2), NAN);
  const std::vector<std::int64_t> qpos = {3};
  attn.attend(v.view(), q.data(), qpos, out.data(), obs.data());
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : obs) EXPECT_EQ(x, 0.0f);
}

TEST(Attention, RejectsAViewOfTheWrongShape) {
  const OwnedView v = random_view(3, 2, 4, 2);
  Attention attn(4, 2, 4, 1, 2);
  std::vector<float> q(16), out(16);
  const std::vector<std::int64_t> qpos = {1};
  EXPECT_THROW(attn.attend(v.view(), q.data(), qpos, out.data(), nullptr), std::invalid_argument);
  EXPECT_THROW(Attention(6, 4, 8, 1, 1), std::invalid_argument);
}

TEST(Attention, ConcatAppendsChunkRowsAndRemapFollowsPositions) {
  const int kv_heads = 2, d = 4;
  OwnedView old = random_view(kv_heads, 3, d, 4);
  old.pos = {0, 7, 3, 0, 7, 3};  // an evicted-and-reused order
  Rng rng(1);
  std::vector<float> k(kv_heads * 2 * d), vv(k.size());
  for (float& x : k) x = rng.uniform();
  for (float& x : vv) x = rng.uniform();
  const std::vector<std::int64_t> pos = {8, 9};
  Attention attn(2, kv_heads, d, 2, 5);
  const CacheView all = attn.concat(old.view(), k.data(), vv.data(), pos);
  ASSERT_EQ(all.tokens, 5u);
  EXPECT_EQ(all.position(0, 1, 1), 7);
  EXPECT_EQ(all.position(0, 1, 4), 9);
  EXPECT_EQ(*all.key_row(0, 1, 3), f32_to_fp16(k[(1 * 2 + 0) * d]));
  EXPECT_EQ(*all.value_row(0, 0, 4), f32_to_fp16(vv[(0 * 2 + 1) * d]));

  // Observation over `all` (values = 10 * column + head), remapped onto a view keeping 9, 3, 8.
  std::vector<float> probs(kv_heads * 5);
  for (int g = 0; g < kv_heads; ++g) {
    for (int i = 0; i < 5; ++i) probs[g * 5 + i] = 10.0f * i + g;
  }
  OwnedView kept = random_view(kv_heads, 3, d, 5);
  kept.pos = {9, 3, 8, 9, 3, 8};
  std::vector<float> out(kv_heads * 3);
  attn.remap_observation(all, probs.data(), 1, kept.view(), out.data());
  for (int g = 0; g < kv_heads; ++g) {
    EXPECT_EQ(out[g * 3 + 0], 40.0f + g);  // position 9: column 4
    EXPECT_EQ(out[g * 3 + 1], 20.0f + g);  // position 3: column 2
    EXPECT_EQ(out[g * 3 + 2], 30.0f + g);  // position 8: column 3
  }
}

TEST(PrefillAttention, ParsesBothModesAndRejectsOthers) {
  EXPECT_EQ(parse_prefill_attention("cache_view"), PrefillAttention::cache_view);
  EXPECT_EQ(parse_prefill_attention("full_prompt"), PrefillAttention::full_prompt);
  EXPECT_EQ(prefill_attention_name(PrefillAttention::full_prompt), "full_prompt");
  EXPECT_THROW(parse_prefill_attention("both"), std::invalid_argument);
}

}  // namespace
}  // namespace kvslim::engine
