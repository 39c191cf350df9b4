// The tensor-parallel seam (kvslim/rank_gather.h): ranks that each hold a slice of the KV heads
// decide what one process over all heads decides. Ranks are threads here, gathering through an
// in-process group (the Python test runs real processes over torch.distributed).
#include <gtest/gtest.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/cross_layer_importance.h"
#include "kvslim/errors.h"
#include "kvslim/rank_gather.h"
#include "kvslim/squeeze.h"

namespace kvslim {
namespace {

// All-gather among `world` threads: each round returns every rank's vector in rank order.
class ThreadGroup {
 public:
  explicit ThreadGroup(std::size_t world) : world_(world), slots_(world) {}
  std::vector<std::vector<double>> gather(std::size_t rank, const std::vector<double>& local) {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::size_t round = round_;
    slots_[rank] = local;
    if (++arrived_ == world_) {
      result_ = slots_;  // no rank can start the next round before every rank has left this one
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round; });
    }
    ++calls_;
    return result_;
  }
  std::size_t calls() const { return calls_; }

 private:
  std::size_t world_, arrived_ = 0, round_ = 0, calls_ = 0;
  std::vector<std::vector<double>> slots_, result_;
  std::mutex mutex_;
  std::condition_variable cv_;
};

class ThreadRank : public RankGather {
 public:
  ThreadRank(ThreadGroup& group, std::size_t rank) : group_(group), rank_(rank) {}
  std::vector<std::vector<double>> all_gather(const std::vector<double>& local) override { return group_.gather(rank_, local); }

 private:
  ThreadGroup& group_;
  std::size_t rank_;
};

// Runs body(rank) on `world` threads; rethrows a rank's exception (the first rank's first).
void run_ranks(std::size_t world, const std::function<void(std::size_t)>& body) {
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

HeadTerms terms(std::vector<double> sums, std::size_t batch) {
  HeadTerms t;
  t.sums = std::move(sums);
  t.counts.assign(t.sums.size(), 1.0);
  t.batch = batch;
  return t;
}

// Batch 2, 4 heads: rank 0 holds heads 0-1 (A), rank 1 heads 2-3 (B). One process sums batch row
// 0 then row 1 ([A0 A1 B0 B1 A2 A3 B2 B3]); values chosen so that another order (the ranks'
// vectors one after the other) rounds differently.
const std::vector<double> kA = {1e16, 1.0, 1.0, 0.0}, kB = {-1e16, 1.0, 0.0, 0.0};

TEST(RankGather, SqueezeConcentrationIsTheOneProcessSumInHeadOrder) {
  SqueezeCoordinator single(2, 64, 4, 1.0);
  single.report_concentration(0, terms({kA[0], kA[1], kB[0], kB[1], kA[2], kA[3], kB[2], kB[3]}, 2));
  single.report_concentration(1, terms({0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8}, 2));
  ASSERT_TRUE(single.is_finalized());
  const double naive = terms({kA[0], kA[1], kA[2], kA[3], kB[0], kB[1], kB[2], kB[3]}, 2).value();
  ASSERT_NE(naive, *single.concentration(0));  // the order matters for these values

  ThreadGroup group(2);
  std::vector<std::vector<double>> concentration(2), budgets(2);
  run_ranks(2, [&](std::size_t r) {
    SqueezeCoordinator c(2, 64, 4, 1.0);
    c.set_rank_gather(std::make_shared<ThreadRank>(group, r));
    c.report_concentration(0, terms(r == 0 ? kA : kB, 2));
    c.report_concentration(1, terms(r == 0 ? std::vector<double>{0.1, 0.2, 0.5, 0.6} : std::vector<double>{0.3, 0.4, 0.7, 0.8}, 2));
    ASSERT_TRUE(c.is_finalized());
    for (int l = 0; l < 2; ++l) {
      concentration[r].push_back(*c.concentration(l));
      budgets[r].push_back(*c.resolved_budget(l));
    }
  });
  EXPECT_EQ(group.calls(), 2u);  // one collective per rank for the whole schedule
  for (std::size_t r = 0; r < 2; ++r) {
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(concentration[r][l], *single.concentration(l)) << "rank " << r << " layer " << l;
      EXPECT_EQ(budgets[r][l], *single.resolved_budget(l)) << "rank " << r << " layer " << l;
    }
  }
}

TEST(RankGather, FirstHeadAndReplicatedSignalsAreRankZeros) {
  ThreadGroup group(2);
  std::vector<double> got(2);
  run_ranks(2, [&](std::size_t r) {
    SqueezeCoordinator c(2, 64, 4, 1.0);
    c.set_rank_gather(std::make_shared<ThreadRank>(group, r));
    // Head 0 of the model is rank 0's first head; rank 1's first head is head 2.
    c.report_concentration(0, HeadTerms::per_head({r == 0 ? 0.25 : 0.75, 0.5}, 1, /*first_only=*/true));
    c.report_concentration(1, r == 0 ? 0.125 : 0.875);  // a signal every rank measures (hidden states)
    got[r] = *c.concentration(0) + 10 * *c.concentration(1);
  });
  EXPECT_EQ(got[0], 0.25 + 10 * 0.125);
  EXPECT_EQ(got[1], got[0]);
}

TEST(RankGather, GlobalTopKMergesEveryRanksScores) {
  // Layers of 4 heads, 2 per rank, 3 evictable rows each; the average budget 3 over 2 protected
  // rows leaves 1 row per head to the global top (8 of 24).
  const std::vector<float> l0_r0 = {0.9f, 0.1f, 0.8f, 0.2f, 0.7f, 0.3f}, l0_r1 = {0.05f, 0.04f, 0.03f, 0.02f, 0.01f, 0.0f};
  const std::vector<float> l1_r0 = {0.6f, 0.6f, 0.5f, 0.5f, 0.4f, 0.4f}, l1_r1 = {0.95f, 0.94f, 0.93f, 0.92f, 0.91f, 0.9f};
  auto cat = [](std::vector<float> a, const std::vector<float>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  SqueezeCoordinator single(2, 3, 1, 1.0);
  single.report_scores(0, cat(l0_r0, l0_r1), 4, 2);
  single.report_scores(1, cat(l1_r0, l1_r1), 4, 2);
  ASSERT_TRUE(single.is_finalized());
  SqueezeCoordinator alone(2, 3, 1, 1.0);  // rank 0 without the others: another schedule
  alone.report_scores(0, l0_r0, 2, 2);
  alone.report_scores(1, l1_r0, 2, 2);
  ASSERT_NE(*alone.resolved_budget(0), *single.resolved_budget(0));

  ThreadGroup group(2);
  std::vector<std::vector<int>> budgets(2);
  run_ranks(2, [&](std::size_t r) {
    SqueezeCoordinator c(2, 3, 1, 1.0);
    c.set_rank_gather(std::make_shared<ThreadRank>(group, r));
    c.report_scores(0, r == 0 ? l0_r0 : l0_r1, 2, 2);
    c.report_scores(1, r == 0 ? l1_r0 : l1_r1, 2, 2);
    budgets[r] = {*c.resolved_budget(0), *c.resolved_budget(1)};
  });
  const std::vector<int> want = {*single.resolved_budget(0), *single.resolved_budget(1)};
  EXPECT_EQ(budgets[0], want);
  EXPECT_EQ(budgets[1], want);
}

TEST(RankGather, RanksThatRunDifferentBatchesAreNamed) {
  ThreadGroup group(2);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](std::size_t r) {
    SqueezeCoordinator c(1, 64, 4, 1.0);
    c.set_rank_gather(std::make_shared<ThreadRank>(group, r));
    try {
      c.report_concentration(0, terms({0.5, 0.5}, r == 0 ? 1 : 2));
    } catch (const InputError& e) {
      errors[r] = e.what();
    }
    EXPECT_FALSE(c.is_finalized());
  });
  EXPECT_NE(errors[0].find("rank 1 reported layer 0 (batch 2)"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 reported layer 0 (batch 1)"), std::string::npos) << errors[1];
}

TEST(RankGather, CrossLayerBoardHoldsTheMaximumOverEveryRanksHeads) {
  ThreadGroup group(2);
  std::vector<std::vector<float>> seen(2, std::vector<float>(3));
  run_ranks(2, [&](std::size_t r) {
    CrossLayerImportance board(2);
    board.set_rank_gather(std::make_shared<ThreadRank>(group, r));
    ASSERT_TRUE(board.join(0, 0));
    // Layer 0: rank 0's head saw positions 1 and 2, rank 1's head positions 2 and 7.
    const std::vector<std::int64_t> pos = r == 0 ? std::vector<std::int64_t>{1, 2} : std::vector<std::int64_t>{2, 7};
    const std::vector<float> val = r == 0 ? std::vector<float>{0.5f, 0.25f} : std::vector<float>{0.75f, 0.125f};
    board.post(0, 0, pos.data(), val.data(), 2);
    board.leave(0);
    ASSERT_TRUE(board.join(1, 0));
    const std::vector<std::int64_t> ask = {1, 2, 7};
    board.read(1, 0, ask.data(), 3, seen[r].data());
    board.leave(1);
  });
  EXPECT_EQ(seen[0], (std::vector<float>{0.5f, 0.75f, 0.125f}));
  EXPECT_EQ(seen[1], seen[0]);
}

}  // namespace
}  // namespace kvslim
