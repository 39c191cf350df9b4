// The device's choice of each head's `drop` lowest rows (src/kvslim/cuda/select_lowest.h) against
// the eviction core's own order (EvictionCore::choose_holes: the lower effective score first, ties
// to the lower position).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/select_lowest.h"
#include "kvslim/cuda.h"

namespace kvslim {
namespace {

#define REQUIRE_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

struct Row {
  float score;
  std::int64_t pos;
};

bool core_lower(const Row& a, const Row& b) { return a.score < b.score || (a.score == b.score && a.pos < b.pos); }

// Scores with many ties (a few quantized levels), both zeros, negative and large values; positions
// distinct, some above 2^31 (the key keeps their low 32 bits unsigned).
std::vector<Row> random_rows(std::size_t n, std::mt19937& rng) {
  const float levels[] = {0.f, -0.f, 1e-30f, 1e-7f, 0.0625f, 0.25f, 1.f, 3.5f, 1e20f, -1e-7f, -2.f};
  std::uniform_int_distribution<int> pick(0, 10), coin(0, 3);
  std::uniform_real_distribution<float> any(0.f, 4.f);
  std::vector<std::int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng);
  std::vector<Row> rows(n);
  for (std::size_t i = 0; i < n; ++i) {
    rows[i].score = coin(rng) == 0 ? any(rng) : levels[pick(rng)];
    rows[i].pos = pos[i] + (i % 7 == 0 ? (std::int64_t{1} << 31) + 12345 : 0) * (pos[i] % 2);
  }
  return rows;
}

// The key order is the core's order, on the host (no GPU needed).
TEST(CudaSelectLowest, KeysOrderAsTheCoreOrdersCandidates) {
  std::mt19937 rng(11);
  const auto rows = random_rows(4000, rng);
  for (std::size_t i = 0; i + 1 < rows.size(); ++i) {
    for (std::size_t j = i + 1; j < std::min(rows.size(), i + 40); ++j) {
      const Row &a = rows[i], &b = rows[j];
      if (a.pos == b.pos) continue;
      const bool keys = cuda::selection_key(a.score, a.pos) < cuda::selection_key(b.score, b.pos);
      ASSERT_EQ(keys, core_lower(a, b)) << a.score << "@" << a.pos << " vs " << b.score << "@" << b.pos;
    }
  }
  EXPECT_EQ(cuda::selection_key(-0.f, 9), cuda::selection_key(0.f, 9));
  EXPECT_LT(cuda::selection_key(-1e30f, 0), cuda::selection_key(1e-30f, 0));
  EXPECT_LT(cuda::selection_key(1e30f, 0xFFFFFFF0LL), cuda::kNotCandidate);
}

// Heads of different lengths and candidate sets; drop from 0 to every candidate, and one head
// asked for more victims than it has candidates (named by kNotCandidate).
TEST(CudaSelectLowest, PicksTheRowsTheCorePicks) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  const std::vector<long long> lengths = {1, 2, 31, 64, 255, 256, 257, 1000, 4099, 33000, 70001};
  const int H = static_cast<int>(lengths.size()) * 3;
  const long long stride = 70001;
  std::vector<std::uint64_t> keys(static_cast<std::size_t>(H) * stride, cuda::kNotCandidate);
  std::vector<int> drop(static_cast<std::size_t>(H));
  std::vector<std::vector<Row>> rows(static_cast<std::size_t>(H));
  std::vector<std::vector<char>> candidate(static_cast<std::size_t>(H));
  std::uniform_int_distribution<int> pct(0, 99);
  for (int h = 0; h < H; ++h) {
    const long long n = lengths[static_cast<std::size_t>(h) / 3];
    rows[h] = random_rows(static_cast<std::size_t>(n), rng);
    candidate[h].assign(static_cast<std::size_t>(n), 0);
    long long candidates = 0;
    for (long long i = 0; i < n; ++i) {
      if (pct(rng) < 85) {
        candidate[h][i] = 1;
        ++candidates;
        keys[h * stride + i] = cuda::selection_key(rows[h][i].score, rows[h][i].pos);
      }
    }
    // drop: none, some, every candidate, one too many (the last head of each length's three).
    const int kind = h % 3;
    if (kind == 0) drop[h] = static_cast<int>(std::uniform_int_distribution<long long>(0, candidates)(rng));
    if (kind == 1) drop[h] = static_cast<int>(candidates);
    if (kind == 2) drop[h] = static_cast<int>(n > 40 ? candidates + 1 : 0);
  }
  cuda::DeviceBuffer keys_dev, drop_dev, kth_dev;
  keys_dev.reserve(keys.size() * sizeof(std::uint64_t));
  drop_dev.reserve(drop.size() * sizeof(int));
  kth_dev.reserve(static_cast<std::size_t>(H) * sizeof(std::uint64_t));
  ASSERT_EQ(cudaMemcpy(keys_dev.get(), keys.data(), keys.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(drop_dev.get(), drop.data(), drop.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  // Every head's n is at most the stride: each head is given the stride's rows, the rest padding.
  cuda::launch_select_lowest(keys_dev.as<std::uint64_t>(), stride, stride, drop_dev.as<int>(), H,
                             kth_dev.as<std::uint64_t>(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::uint64_t> kth(static_cast<std::size_t>(H));
  ASSERT_EQ(cudaMemcpy(kth.data(), kth_dev.get(), kth.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);

  for (int h = 0; h < H; ++h) {
    const std::string what = "head " + std::to_string(h) + " of " + std::to_string(rows[h].size()) + " rows, drop " +
                             std::to_string(drop[h]);
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < rows[h].size(); ++i) {
      if (candidate[h][i]) order.push_back(i);
    }
    if (static_cast<std::size_t>(drop[h]) > order.size()) {
      EXPECT_EQ(kth[h], cuda::kNotCandidate) << what;
      continue;
    }
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return core_lower(rows[h][a], rows[h][b]); });
    std::vector<char> expected(rows[h].size(), 0);
    for (int i = 0; i < drop[h]; ++i) expected[order[static_cast<std::size_t>(i)]] = 1;
    std::size_t chosen = 0;
    for (std::size_t i = 0; i < rows[h].size(); ++i) {
      const bool victim = keys[h * stride + i] <= kth[h];
      chosen += victim ? 1 : 0;
      ASSERT_EQ(victim, expected[i] != 0) << what << ": row " << i << " (score " << rows[h][i].score << ", position "
                                          << rows[h][i].pos << ")";
    }
    EXPECT_EQ(chosen, static_cast<std::size_t>(drop[h])) << what;
  }
}

}  // namespace
}  // namespace kvslim
