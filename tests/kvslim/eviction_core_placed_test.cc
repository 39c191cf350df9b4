// The eviction core over a storage whose owner places the rows (EvictionCore::absorb_placed: what
// the GPU's device slots and kivi codes do), checked on the host: streaming's admission (scoring
// none) by moves keeps the rows the core keeps when it absorbs them itself, in the same slots, and
// the room the rows arrived in is given back once they are admitted; over a storage without slot
// writes (kivi codes) it erases the victims and keeps the rows, in the order, of the CPU's kivi
// storage under the same policy.
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cache/eviction_core.h"
#include "kvslim/config.h"
#include "storage/packed_rows.h"
#include "storage/row_storage.h"

namespace kvslim {
namespace {

// A slot storage holding each row's position as its only content. prepare() is the owner's append
// (the call's rows after the kept ones); the core's moves are applied as they come.
class PlacedPositions final : public RowStorage {
 public:
  std::size_t kept = 0;                // the core's rows before the call (the owner knows them)
  std::vector<std::int64_t> arriving;  // the call's positions
  std::vector<std::int64_t> slots;     // [heads, capacity]
  std::size_t heads = 0, capacity = 0;
  int moves = 0;

  std::string_view kind() const override { return "fp16"; }
  bool slot_writes() const override { return true; }
  void begin(std::size_t heads_total, std::size_t) override { heads = heads_total; }
  void relayout(std::size_t new_capacity, std::size_t keep) override {
    std::vector<std::int64_t> next(heads * new_capacity, -1);
    for (std::size_t h = 0; h < heads; ++h) {
      for (std::size_t i = 0; i < keep; ++i) next[h * new_capacity + i] = slots[h * capacity + i];
    }
    slots = std::move(next);
    capacity = new_capacity;
  }
  void prepare(std::size_t incoming) override {
    ASSERT_EQ(incoming, arriving.size());
    ASSERT_LE(kept + incoming, capacity) << "the core made no room for the placed rows";
    for (std::size_t h = 0; h < heads; ++h) {
      for (std::size_t s = 0; s < incoming; ++s) slots[h * capacity + kept + s] = arriving[s];
    }
  }
  void write(std::size_t, std::size_t, const std::uint16_t*, const std::uint16_t*) override {
    ADD_FAILURE() << "the core wrote a placed row";
  }
  void move(std::size_t head, std::size_t from, std::size_t to) override {
    slots[head * capacity + to] = slots[head * capacity + from];
    ++moves;
  }
  void erase(std::size_t, std::span<const std::size_t>) override { ADD_FAILURE() << "slot storages are not erased"; }
  void key_logits(std::size_t, std::size_t, const float*, float*) const override { ADD_FAILURE() << "no key proxy"; }
  void feed(attend::HeadAttention&, std::size_t, const std::int64_t*, std::size_t) const override {}
  CacheView view(std::size_t, std::size_t, std::size_t, const std::int64_t*, std::size_t) const override { return {}; }
  std::size_t resident_bytes() const override { return slots.size() * sizeof(std::int64_t); }
  void reset() override {
    slots.clear();
    capacity = 0;
  }
};

// A storage without slot writes holding each row's position as its only content, in order:
// prepare() appends the call's rows after the kept ones; the core's erasures close up the rest.
class PlacedInOrder final : public RowStorage {
 public:
  std::vector<std::int64_t> arriving;           // the call's positions
  std::vector<std::vector<std::int64_t>> rows;  // [heads][rows held]
  int erased = 0, settles = 0;

  std::string_view kind() const override { return "kivi"; }
  bool slot_writes() const override { return false; }
  void begin(std::size_t heads_total, std::size_t) override { rows.assign(heads_total, {}); }
  void relayout(std::size_t, std::size_t) override {}
  void prepare(std::size_t incoming) override {
    ASSERT_EQ(incoming, arriving.size());
    for (auto& head : rows) head.insert(head.end(), arriving.begin(), arriving.end());
  }
  void write(std::size_t, std::size_t, const std::uint16_t*, const std::uint16_t*) override {
    ADD_FAILURE() << "the core wrote a placed row";
  }
  void move(std::size_t, std::size_t, std::size_t) override { ADD_FAILURE() << "rows without slots never move"; }
  void erase(std::size_t head, std::span<const std::size_t> slots) override {
    for (std::size_t i = slots.size(); i-- > 0;) {
      ASSERT_LT(slots[i], rows[head].size()) << "an erasure past the rows held";
      ASSERT_TRUE(i == 0 || slots[i - 1] < slots[i]) << "erasures must be ascending";
      rows[head].erase(rows[head].begin() + static_cast<std::ptrdiff_t>(slots[i]));
      ++erased;
    }
  }
  void settle(std::size_t n, const Saliency&) override {
    ++settles;
    for (const auto& head : rows) ASSERT_EQ(head.size(), n) << "settled with rows the core does not hold";
  }
  void key_logits(std::size_t, std::size_t, const float*, float*) const override { ADD_FAILURE() << "no key proxy"; }
  void feed(attend::HeadAttention&, std::size_t, const std::int64_t*, std::size_t) const override {}
  CacheView view(std::size_t, std::size_t, std::size_t, const std::int64_t*, std::size_t) const override { return {}; }
  std::size_t resident_bytes() const override { return 0; }
  void reset() override { rows.clear(); }
};

// kivi codes as the tests' CPU caches keep them: groups of 32 rows, a window compressed every 32.
PackedRowsOptions kivi_g32() {
  PackedRowsOptions o;
  o.group_size = 32;
  o.staging = 32;
  return o;
}

// One call: `S` rising positions from `next` on (`stride` apart; `next` moves past them) and rows
// whose content does not matter, [heads, S, D] fp16.
struct Call {
  std::vector<std::int64_t> pos;
  std::vector<std::uint16_t> rows;
};
Call next_call(std::int64_t& next, std::size_t S, std::size_t heads, std::size_t D, std::int64_t stride = 1) {
  Call c{std::vector<std::int64_t>(S), std::vector<std::uint16_t>(heads * S * D)};
  for (std::size_t s = 0; s < S; ++s) c.pos[s] = next + stride * static_cast<std::int64_t>(s);
  next += stride * static_cast<std::int64_t>(S);
  for (std::size_t i = 0; i < c.rows.size(); ++i) c.rows[i] = static_cast<std::uint16_t>(0x3800 + i % 509);
  return c;
}

TEST(EvictionCorePlaced, StreamingAdmitsPlacedRowsAsItAdmitsItsOwn) {
  KVCacheConfig c;
  c.streaming_budget = 80;
  const EvictionPolicy policy = make_streaming_policy(c);
  const std::size_t batch = 2, kv_heads = 2, heads = batch * kv_heads, D = 8, limit = 80;
  EvictionCore own(policy);
  auto placed_storage = std::make_unique<PlacedPositions>();
  PlacedPositions& placed_rows = *placed_storage;
  EvictionCore placed(policy, std::move(placed_storage));

  std::int64_t next = 0;
  const auto call = [&](std::size_t S, const std::string& what) {
    std::vector<std::int64_t> pos(S);
    for (std::size_t s = 0; s < S; ++s) pos[s] = next++;
    const std::vector<std::uint16_t> rows(heads * S * D, 0x3c00);  // fp16 1.0: the content does not matter
    own.absorb(batch, kv_heads, D, rows.data(), rows.data(), pos.data(), S, limit);
    placed_rows.kept = placed.rows();
    placed_rows.arriving = pos;
    placed.absorb_placed(batch, kv_heads, D, pos.data(), S, limit);
    ASSERT_EQ(placed.rows(), own.rows()) << what;
    for (std::size_t h = 0; h < heads; ++h) {
      for (std::size_t i = 0; i < own.rows(); ++i) {
        ASSERT_EQ(placed.positions(h)[i], own.positions(h)[i]) << what << ": head " << h << " slot " << i;
        ASSERT_EQ(placed_rows.slots[h * placed_rows.capacity + i], own.positions(h)[i])
            << what << ": the storage's row in head " << h << " slot " << i << " is not the core's";
      }
    }
  };
  call(300, "a prompt over the budget");
  EXPECT_EQ(placed.rows(), limit);
  EXPECT_EQ(placed.positions(0)[0], 0);  // the sinks stay
  EXPECT_EQ(placed_rows.capacity, limit + 1) << "the prompt's arrival room was not given back";
  for (int s = 0; s < 40; ++s) call(1, "decode step " + std::to_string(s));
  EXPECT_EQ(placed_rows.capacity, limit + 1) << "a decode step reallocated the store";
  call(37, "a later call");
  call(50, "a third call");
  EXPECT_GT(placed_rows.moves, 0);
}

TEST(EvictionCorePlaced, StreamingErasesBeforePlacedRowsAsOverKiviCodes) {
  KVCacheConfig c;
  c.streaming_budget = 72;
  c.streaming_n_sink = 3;
  const EvictionPolicy policy = make_streaming_policy(c);
  const std::size_t batch = 2, kv_heads = 2, heads = batch * kv_heads, D = 32, limit = 72;
  EvictionCore own(policy, std::make_unique<PackedRows>(kivi_g32()));  // the CPU cache: rows written by the core
  auto placed_storage = std::make_unique<PlacedInOrder>();
  PlacedInOrder& placed_rows = *placed_storage;
  EvictionCore placed(policy, std::move(placed_storage));

  std::int64_t next = 0;
  const auto call = [&](std::size_t S, const std::string& what) {
    const Call in = next_call(next, S, heads, D);
    own.absorb(batch, kv_heads, D, in.rows.data(), in.rows.data(), in.pos.data(), S, limit);
    placed_rows.arriving = in.pos;
    placed.absorb_placed(batch, kv_heads, D, in.pos.data(), S, limit);
    ASSERT_EQ(placed.rows(), own.rows()) << what;
    for (std::size_t h = 0; h < heads; ++h) {
      ASSERT_EQ(placed_rows.rows[h].size(), placed.rows()) << what << ": head " << h;
      for (std::size_t i = 0; i < own.rows(); ++i) {
        ASSERT_EQ(placed.positions(h)[i], own.positions(h)[i]) << what << ": head " << h << " slot " << i;
        ASSERT_EQ(placed_rows.rows[h][i], own.positions(h)[i])
            << what << ": the storage's row in head " << h << " slot " << i << " is not the core's";
      }
    }
  };
  call(20, "a prompt under the budget");
  call(300, "a prompt over the budget");
  EXPECT_EQ(placed.rows(), limit);
  EXPECT_EQ(placed.positions(0)[0], 0);  // the sinks stay
  EXPECT_EQ(placed.positions(0)[3], 320 - (limit - 3)) << "after the sinks, the newest rows";
  for (int s = 0; s < 90; ++s) call(1, "decode step " + std::to_string(s));
  call(37, "a later call");
  EXPECT_GT(placed_rows.erased, 300);
  EXPECT_EQ(placed_rows.settles, 93) << "every call settles once its eviction is done";
}

// The device's streaming over kivi codes: at its limit a decode row is admitted by the owner
// (owner_may_admit, admit_by_owner): it places the row after the kept ones and erases the oldest
// row after the sinks below the core's threshold (the decode observation by position); the core's
// metadata is written back before it decides on the host again. The rows equal the CPU kivi
// cache's, whose core admits every row itself, through 150 steps and the host calls around them.
TEST(EvictionCorePlaced, StreamingOwnerEvictsTheRowTheCoreWould) {
  KVCacheConfig c;
  c.streaming_budget = 72;
  c.streaming_n_sink = 3;
  const EvictionPolicy policy = make_streaming_policy(c);
  const std::size_t batch = 2, kv_heads = 2, heads = batch * kv_heads, D = 32, limit = 72, n_sink = 3;
  EvictionCore own(policy, std::make_unique<PackedRows>(kivi_g32()));
  auto placed_rows_owned = std::make_unique<PlacedInOrder>();
  PlacedInOrder& placed_rows = *placed_rows_owned;
  EvictionCore placed(policy, std::move(placed_rows_owned));

  bool stale = false;  // the owner's steps since the core last decided
  int by_owner = 0;
  std::int64_t next = 0;
  const auto call = [&](std::size_t S, const std::string& what) {
    const Call in = next_call(next, S, heads, D);
    const std::vector<std::int64_t>& pos = in.pos;
    own.absorb(batch, kv_heads, D, in.rows.data(), in.rows.data(), pos.data(), S, limit);
    if (S == 1 && placed.owner_may_admit(limit, pos[0])) {
      const std::int64_t threshold = placed.admit_by_owner(pos[0], limit);
      for (auto& head : placed_rows.rows) {
        head.push_back(pos[0]);
        std::size_t victim = head.size();
        for (std::size_t i = 0; i < head.size(); ++i) {
          if (head[i] > head[n_sink - 1] && head[i] < threshold && (victim == head.size() || head[i] < head[victim])) victim = i;
        }
        ASSERT_LT(victim, head.size()) << what << ": no victim";
        head.erase(head.begin() + static_cast<std::ptrdiff_t>(victim));
      }
      placed.observed_by_owner(limit, limit);
      stale = true;
      ++by_owner;
    } else {
      if (stale) {  // the owner's rows back into the core before it decides
        const EvictionCore::Metadata m = placed.metadata();
        for (std::size_t h = 0; h < heads; ++h) {
          for (std::size_t i = 0; i < placed.rows(); ++i) m.positions[h * m.stride + i] = placed_rows.rows[h][i];
        }
        stale = false;
      }
      placed_rows.arriving = pos;
      placed.absorb_placed(batch, kv_heads, D, pos.data(), S, limit);
    }
    ASSERT_EQ(placed.rows(), own.rows()) << what;
    for (std::size_t h = 0; h < heads; ++h) {
      ASSERT_EQ(placed_rows.rows[h].size(), own.rows()) << what << ": head " << h;
      for (std::size_t i = 0; i < own.rows(); ++i) {
        ASSERT_EQ(placed_rows.rows[h][i], own.positions(h)[i]) << what << ": head " << h << " slot " << i;
      }
    }
  };
  call(20, "a prompt under the budget");
  EXPECT_FALSE(placed.owner_may_admit(limit, next)) << "below its limit the core appends";
  call(300, "a prompt over the budget");
  EXPECT_FALSE(placed.owner_may_admit(limit, next - 1)) << "a newcomer older than the window";
  for (int s = 0; s < 150; ++s) call(1, "decode step " + std::to_string(s));
  EXPECT_EQ(by_owner, 150);
  call(37, "a later call");
  for (int s = 0; s < 40; ++s) call(1, "decode step after the call " + std::to_string(s));
  EXPECT_EQ(by_owner, 190);
  EXPECT_EQ(placed.positions(0)[0], 0);  // the sinks stay
  EXPECT_THROW(placed.admit_by_owner(next - 1, limit), std::logic_error);
}

// Scoring none's admission, token by token as the core documents it (admit(): append below the
// limit, else the lowest (score, position) after the sinks below the token's threshold leaves, or
// an unprotected newcomer is dropped), over positions and scores only: the reference the core's
// one-pass admission (admit_in_order) must equal.
struct ReferenceRows {
  std::vector<std::int64_t> pos;
  std::vector<float> score;
};
void reference_admit(ReferenceRows& r, const EvictionPolicy& p, bool slot_writes, std::deque<std::int64_t>& recent,
                     const std::vector<std::int64_t>& call, std::size_t limit) {
  std::size_t window = p.recent_window;
  if (p.recent_fits_budget) window = std::min(window, (limit > p.n_sink ? limit - p.n_sink : 0) / 2);
  std::vector<std::int64_t> thresholds;
  for (const std::int64_t x : call) {
    if (p.recent_window > 0) {
      recent.push_back(x);
      if (recent.size() > p.recent_window) recent.pop_front();
    }
    const std::size_t w = std::min(window, recent.size());
    thresholds.push_back(w == 0 ? std::numeric_limits<std::int64_t>::max() : recent[recent.size() - w]);
  }
  const bool protect = p.recent_window > 0 && std::min(window, recent.size()) > 0;
  for (std::size_t s = 0; s < call.size(); ++s) {
    const std::size_t n = r.pos.size();
    if (n == 0 || n < limit) {
      r.pos.push_back(call[s]);
      r.score.push_back(n == 0 ? 1.0f : 0.0f);
      continue;
    }
    std::size_t victim = n;
    for (std::size_t j = p.n_sink; j < n; ++j) {
      if (r.pos[j] >= thresholds[s]) continue;
      if (victim == n || r.score[j] < r.score[victim] || (r.score[j] == r.score[victim] && r.pos[j] < r.pos[victim])) victim = j;
    }
    if (!protect && (victim == n || r.score[victim] > 0.0f)) continue;
    ASSERT_LT(victim, n) << "no evictable row";
    if (slot_writes) {
      r.pos[victim] = call[s];
      r.score[victim] = 0.0f;
    } else {
      r.pos.erase(r.pos.begin() + static_cast<std::ptrdiff_t>(victim));
      r.score.erase(r.score.begin() + static_cast<std::ptrdiff_t>(victim));
      r.pos.push_back(call[s]);
      r.score.push_back(0.0f);
    }
  }
}

// Streaming's calls (rising positions) are admitted in one pass: the rows, scores and slots equal
// the token-by-token reference for every storage (fp16 slots and kivi codes written by the core,
// both placed by an owner), with and without sinks (the first token's score 1.0 then shields it),
// with a recent window, a window fitted to the budget, and none (newcomers dropped when the only
// candidate is that first row).
TEST(EvictionCorePlaced, StreamingAdmitsACallInOnePassAsTokenByToken) {
  struct Case {
    std::size_t n_sink, recent_window, limit;
    bool fits;
  };
  for (const Case cs : {Case{4, 68, 72, false}, Case{0, 71, 72, false}, Case{3, 500, 40, true}, Case{0, 0, 1, false},
                        Case{2, 0, 16, false}}) {
    EvictionPolicy policy;
    policy.scoring = Scoring::none;
    policy.n_sink = cs.n_sink;
    policy.recent_window = cs.recent_window;
    policy.recent_fits_budget = cs.fits;
    const std::size_t batch = 1, kv_heads = 2, heads = 2, D = 32;
    for (int kind = 0; kind < 4; ++kind) {  // fp16 slots, kivi codes, placed slots, placed in order
      const bool slot_writes = kind == 0 || kind == 2, placed = kind >= 2;
      std::unique_ptr<RowStorage> storage;
      PlacedPositions* placed_slots = nullptr;
      PlacedInOrder* placed_order = nullptr;
      if (kind == 1) storage = std::make_unique<PackedRows>(kivi_g32());
      if (kind == 2) {
        auto st = std::make_unique<PlacedPositions>();
        placed_slots = st.get();
        storage = std::move(st);
      }
      if (kind == 3) {
        auto st = std::make_unique<PlacedInOrder>();
        placed_order = st.get();
        storage = std::move(st);
      }
      EvictionCore core(policy, std::move(storage));
      ReferenceRows ref;
      std::deque<std::int64_t> recent;
      std::int64_t next = 5;
      const std::string what = "n_sink " + std::to_string(cs.n_sink) + ", window " + std::to_string(cs.recent_window) +
                               (cs.fits ? " (fitted)" : "") + ", limit " + std::to_string(cs.limit) + ", storage " +
                               std::to_string(kind);
      // (calls of 64 tokens or more take the one pass; shorter ones the scan per token, between them)
      for (const std::size_t S : {std::size_t{20}, std::size_t{300}, std::size_t{1}, std::size_t{1}, std::size_t{37},
                                  std::size_t{64}, std::size_t{1}, std::size_t{500}, std::size_t{63}, std::size_t{3}}) {
        const Call in = next_call(next, S, heads, D, /*stride=*/2);  // gaps: any rising positions
        const std::vector<std::int64_t>& pos = in.pos;
        reference_admit(ref, policy, slot_writes, recent, pos, cs.limit);
        if (placed) {
          if (placed_slots) {
            placed_slots->kept = core.rows();
            placed_slots->arriving = pos;
          }
          if (placed_order) placed_order->arriving = pos;
          core.absorb_placed(batch, kv_heads, D, pos.data(), S, cs.limit);
        } else {
          core.absorb(batch, kv_heads, D, in.rows.data(), in.rows.data(), pos.data(), S, cs.limit);
        }
        ASSERT_EQ(core.rows(), ref.pos.size()) << what << ", call of " << S;
        for (std::size_t h = 0; h < heads; ++h) {
          for (std::size_t i = 0; i < ref.pos.size(); ++i) {
            ASSERT_EQ(core.positions(h)[i], ref.pos[i]) << what << ", call of " << S << ": head " << h << " slot " << i;
            ASSERT_EQ(core.scores(h)[i], ref.score[i]) << what << ", call of " << S << ": head " << h << " slot " << i;
            if (placed_slots) {
              ASSERT_EQ(placed_slots->slots[h * placed_slots->capacity + i], ref.pos[i]) << what;
            }
            if (placed_order) {
              ASSERT_EQ(placed_order->rows[h][i], ref.pos[i]) << what;
            }
          }
        }
      }
    }
  }
}

TEST(EvictionCorePlaced, RefusesWhatItCannotPlace) {
  KVCacheConfig c;
  c.evict_profile = "original";  // the key proxy reads the rows, which the core never sees
  EvictionCore core(make_eviction_policy(c, 4), std::make_unique<PlacedPositions>());
  const std::int64_t pos[1] = {0};
  EXPECT_THROW(core.absorb_placed(1, 1, 8, pos, 1, 16), std::logic_error);
}

}  // namespace
}  // namespace kvslim
