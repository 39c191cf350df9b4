#include "eviction_core.h"
#include "cache/observation_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <exception>
#include <functional>
#include <thread>

#include "attend/head_attention.h"
#include "cache/row_scores.h"
#include "kernels.h"
#include "kvslim/convert.h"
#include "kvslim/config.h"
#include "kvslim/errors.h"

namespace kvslim {

Scoring parse_scoring(const std::string& name) {
  if (name == "key_proxy") return Scoring::key_proxy;
  if (name == "attention") return Scoring::attention;
  if (name == "attention_normalized") return Scoring::attention_normalized;
  if (name == "none") return Scoring::none;
  throw ConfigError("evict_scoring = \"" + name + "\": must be one of key_proxy, attention, attention_normalized");
}

EvictionPolicy make_streaming_policy(const KVCacheConfig& c) {
  EvictionPolicy p;
  p.scoring = Scoring::none;
  p.n_sink = static_cast<std::size_t>(c.streaming_n_sink);
  p.recent_window = static_cast<std::size_t>(c.streaming_budget - c.streaming_n_sink);
  return p;
}

EvictionPolicy make_eviction_policy(const KVCacheConfig& c, int n_sink) {
  // evict_profile gives every "auto" field its value: "original" is the documented H2O core (key
  // proxy, no window, no decay); "query_aware" is what measurement on a real model supports
  // (docs/methods.md, docs/results.md): a recent window, and a SnapKV-style prefill that scores
  // the prompt by the attention of its last queries, pooled, then normalised accumulation.
  const bool original = c.evict_profile == "original";
  EvictionPolicy p;
  p.n_sink = static_cast<std::size_t>(n_sink);
  p.recent_fits_budget = !original && c.evict_recent_window < 0;
  p.recent_window = static_cast<std::size_t>(c.evict_recent_window >= 0 ? c.evict_recent_window : original ? 0 : 32);
  const std::string scoring = c.evict_scoring != "auto" ? c.evict_scoring : original ? "key_proxy" : "attention_normalized";
  if (const RowScore* registered = find_row_score(scoring)) {
    p.scoring = registered->base;
    p.row_weight = registered->row_weight;
  } else {
    p.scoring = parse_scoring(scoring);
  }
  // Window 16 / pool 15, not SnapKV's 32 / 5: on models/tiny the last 16 queries are the question
  // and the line before it, and a 15-wide pool keeps the whole answer span (32 / 5 retrieved no
  // passkey even at 50 % of the bytes). With cross-layer importance, 16 beats 8 at 25 % of the
  // bytes on every figure (docs/results.md table G: ood KL 0.146 vs 0.167, kvlist 1.00 vs 0.94).
  p.obs_window = static_cast<std::size_t>(c.evict_obs_window >= 0 ? c.evict_obs_window : original ? 0 : 16);
  p.pool_kernel = static_cast<std::size_t>(c.evict_pool_kernel >= 1 ? c.evict_pool_kernel : original ? 1 : 15);
  p.decay = static_cast<float>(c.evict_decay >= 0.0 ? c.evict_decay : 1.0);
  // Cross-layer importance on by default at weight 0.1: on models/tiny it lifts the passkey from
  // 0.40 to 1.00 at 6.25 % of the bytes; higher weights crowd out what a multi-key question needs
  // (kvlist 0.72 alone, 0.60 at 0.1, 0.10 at 1; docs/results.md table G).
  p.cross_layer = static_cast<float>(c.evict_cross_layer >= 0.0 ? c.evict_cross_layer : original ? 0.0 : 0.1);
  return p;
}

struct AbsorbScratch {
  std::vector<float> query;   // [D]
  std::vector<float> logits;  // [capacity]
  // Blocked key-proxy scoring (absorb_head_blocked):
  std::vector<float> kt;             // [D, padded capacity] the head's stored keys, transposed fp32
  std::vector<float> block_queries;  // [kBlockTokens, D] the block's incoming keys, fp32
  std::vector<float> block_logits;   // [kBlockTokens, padded capacity] against the rows at block start
  std::vector<float> block_keys_t;   // [D, kBlockTokens] the block's keys, transposed
  std::vector<float> block_self;     // [kBlockTokens, kBlockTokens] the block's keys against each other
  std::vector<int> source;           // [capacity] -1: row stored before the block; b: written by block token b
  std::vector<std::size_t> touched;  // slots the current block wrote (each once)
  std::size_t bytes() const {
    return (query.capacity() + logits.capacity() + kt.capacity() + block_queries.capacity() + block_logits.capacity() +
            block_keys_t.capacity() + block_self.capacity()) *
               sizeof(float) +
           source.capacity() * sizeof(int) + touched.capacity() * sizeof(std::size_t);
  }
};

namespace {
// A newcomer at the limit: dropped where it is not protected and the lowest evictable row (if any)
// scores above 0 (it would outrank the newcomer's 0); protected with no evictable row, the budget
// cannot hold the sinks and the window.
bool drops_newcomer(bool newcomer_protected, bool has_victim, float victim_score) {
  if (!newcomer_protected && (!has_victim || victim_score > 0.0f)) return true;
  if (!has_victim) throw std::logic_error("eviction core: no evictable row (sinks + recent window >= budget)");
  return false;
}

// Below this much scoring work per call (multiply-adds) a second thread costs more than it saves.
constexpr double kThreadWork = 4e6;
// Below this much observation work (heads x rows x window queries) a prompt's scoring stays on one
// thread; above it, up to kMaxObserveThreads threads share the heads.
constexpr double kObserveThreadWork = 2e6;
constexpr std::size_t kMaxObserveThreads = 16;
// A scratch larger than this (a very long cache's transposed keys) is freed after use, not pooled.
constexpr std::size_t kPooledScratchBytes = std::size_t{16} << 20;

// Every absorbing thread borrows its scratch here: one per concurrent absorb, reused by every
// layer and call (fresh pages cost a fault each, expensive on virtual machines).
class ScratchPool {
 public:
  std::unique_ptr<AbsorbScratch> acquire() {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return std::make_unique<AbsorbScratch>();
    auto s = std::move(free_.back());
    free_.pop_back();
    return s;
  }
  void release(std::unique_ptr<AbsorbScratch> s) {
    if (s->bytes() > kPooledScratchBytes) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(s));
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<AbsorbScratch>> free_;
};

ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}

// A pooled scratch for the scope of one absorb.
class BorrowedScratch {
 public:
  BorrowedScratch() : s_(scratch_pool().acquire()) {}
  ~BorrowedScratch() { scratch_pool().release(std::move(s_)); }
  BorrowedScratch(const BorrowedScratch&) = delete;
  BorrowedScratch& operator=(const BorrowedScratch&) = delete;
  AbsorbScratch& get() { return *s_; }

 private:
  std::unique_ptr<AbsorbScratch> s_;
};
}  // namespace

EvictionCore::EvictionCore(EvictionPolicy policy, std::unique_ptr<RowStorage> storage)
    : policy_(policy), storage_(storage ? std::move(storage) : make_fp16_storage()) {}

std::size_t EvictionCore::recent_count(std::size_t limit) const {
  std::size_t r = policy_.recent_window;
  if (policy_.recent_fits_budget && limit != EvictionPolicy::kUnbounded) {
    const std::size_t room = limit > policy_.n_sink ? limit - policy_.n_sink : 0;
    r = std::min(r, room / 2);
  }
  return std::min(r, recent_.size());
}

std::int64_t EvictionCore::recent_threshold(std::size_t limit) const {
  const std::size_t r = recent_count(limit);
  return r == 0 ? std::numeric_limits<std::int64_t>::max() : recent_[recent_.size() - r];
}

void EvictionCore::absorb(std::size_t batch, std::size_t heads, std::size_t dim, const std::uint16_t* keys16,
                          const std::uint16_t* values16, const std::int64_t* positions, std::size_t S,
                          std::size_t limit) {
  if (batch_ == 0) {
    batch_ = batch;
    heads_ = heads;
    dim_ = dim;
    storage_->begin(batch * heads, dim);
  }
  const bool placed = keys16 == nullptr && values16 == nullptr;  // absorb_placed
  // Placed rows: an attention scoring appends them at the end of every head (any storage); scoring
  // none admits them where they lie (moved into their slots, or their victims erased before them).
  if (placed && (scoring() == Scoring::key_proxy || awaiting_observation_ || policy_.row_weight != nullptr)) {
    throw std::logic_error("eviction core: placed rows need an attention scoring (every update observed), or scoring "
                           "none, without a row score");
  }
  if (scores_by_attention(scoring()) && awaiting_observation_) {
    // The last update's attention never came: this integrator does not report attention. Score by
    // the key proxy from now on, and bring the rows the last update appended back to its limit.
    fallback_ = true;
    if (last_limit_ != kNone && rows_ > last_limit_) drop_lowest(rows_ - last_limit_);
  }
  last_limit_ = limit;
  const bool append_only = scores_by_attention(scoring());
  // Placed rows arrive after the kept ones before the core admits them: room for all of them.
  const std::size_t needed = append_only || placed ? rows_ + S : std::min(rows_ + S, limit);
  // Growth bound: geometric without a limit (full: amortised O(1) copies per row), the budget plus
  // the one row a decode step appends before observe() for attention scorings, else the budget.
  std::size_t bound = EvictionPolicy::kUnbounded;
  if (limit != EvictionPolicy::kUnbounded) bound = std::max(needed, append_only ? limit + 1 : limit);
  reserve_rows(needed, bound);

  // A call whose positions rise past every position held: its thresholds rise too, which scoring
  // none's admission in one pass needs (admit_in_order). Shorter calls (a decode step) keep the scan
  // per token: cheaper than the pass's ordering of the rows held.
  in_order_call_ = S >= kOnePassTokens && positions[0] > newest_;
  for (std::size_t s = 1; s < S && in_order_call_; ++s) in_order_call_ = positions[s] > positions[s - 1];
  // The recent-window threshold after each token: rows at or above it are protected.
  thresholds_.resize(S);
  for (std::size_t s = 0; s < S; ++s) {
    newest_ = std::max(newest_, positions[s]);
    if (policy_.recent_window > 0) {
      recent_.push_back(positions[s]);
      if (recent_.size() > policy_.recent_window) recent_.pop_front();
    }
    thresholds_[s] = recent_threshold(limit);
  }

  storage_->prepare(S);
  const std::size_t total = heads_total();
  const double work = static_cast<double>(S) * static_cast<double>(needed) * static_cast<double>(dim) *
                      static_cast<double>(total);
  if (scoring() == Scoring::key_proxy && total >= 2 && work >= kThreadWork) {
    const std::size_t half = total / 2;
    BorrowedScratch mine, other;
    std::thread worker([&] { absorb_heads(half, total, keys16, values16, positions, S, limit, thresholds_.data(), other.get()); });
    absorb_heads(0, half, keys16, values16, positions, S, limit, thresholds_.data(), mine.get());
    worker.join();
  } else {
    BorrowedScratch mine;
    absorb_heads(0, total, keys16, values16, positions, S, limit, thresholds_.data(), mine.get());
  }
  rows_ = head_rows_;
  awaiting_observation_ = append_only;
  // Placed rows admitted: give back the room they arrived in (a decode step's one row stays).
  if (placed && !append_only && limit != EvictionPolicy::kUnbounded && capacity_ > limit + 1 + limit / 8) {
    relayout(std::max(rows_, limit + 1));
  }
  if (!append_only) settle();  // this step's eviction is done (attention scorings evict in observe)
}

void EvictionCore::absorb_placed(std::size_t batch, std::size_t heads, std::size_t dim, const std::int64_t* positions,
                                 std::size_t S, std::size_t limit) {
  absorb(batch, heads, dim, nullptr, nullptr, positions, S, limit);
}

void EvictionCore::settle() {
  if (rows_ > hold_above_) return;
  storage_->settle(rows_, [this](std::size_t head, std::size_t slot) { return effective_score(head, slot); });
}

void EvictionCore::feed(attend::HeadAttention& ha, std::size_t head) const {
  storage_->feed(ha, head, positions_.data() + head * capacity_, rows_);
}

void EvictionCore::absorb_heads(std::size_t head_begin, std::size_t head_end, const std::uint16_t* keys16,
                                const std::uint16_t* values16, const std::int64_t* positions, std::size_t S,
                                std::size_t limit, const std::int64_t* recent_threshold, AbsorbScratch& scratch) {
  const std::size_t D = dim_;
  scratch.query.resize(D);
  if (scratch.logits.size() < capacity_) scratch.logits.resize(capacity_);
  const Scoring scoring_now = scoring();
  // The blocked scorer reads stored keys by slot: fp16 slots only.
  const bool blocked = scoring_now == Scoring::key_proxy && S >= kBlockTokens && storage_->slot_writes();
  std::size_t final_rows = rows_;
  for (std::size_t head = head_begin; head < head_end; ++head) {
    if (keys16 == nullptr) {  // absorb_placed: the rows are in the storage already
      if (scores_by_attention(scoring_now)) {
        for (std::size_t s = 0; s < S; ++s) write_metadata(head, rows_ + s, positions[s], 0.0f);
        final_rows = rows_ + S;
      } else if (in_order_call_) {
        final_rows = admit_in_order(head, nullptr, nullptr, positions, S, limit, recent_threshold);
      } else {
        final_rows = absorb_head_placed(head, positions, S, limit, recent_threshold);
      }
      continue;
    }
    const std::uint16_t* k = keys16 + head * S * D;
    const std::uint16_t* v = values16 + head * S * D;
    if (scores_by_attention(scoring_now)) {
      for (std::size_t s = 0; s < S; ++s) write_row(head, rows_ + s, k + s * D, v + s * D, positions[s], 0.0f);
      final_rows = rows_ + S;
    } else if (scoring_now == Scoring::none && in_order_call_) {
      final_rows = admit_in_order(head, k, v, positions, S, limit, recent_threshold);
    } else if (blocked) {
      final_rows = absorb_head_blocked(head, k, v, positions, S, limit, recent_threshold, scratch);
    } else {
      final_rows = absorb_head_sequential(head, k, v, positions, S, limit, recent_threshold, scratch);
    }
  }
  if (head_begin == 0) head_rows_ = final_rows;  // every head ends with the same count
}

bool EvictionCore::newcomer_protected(std::size_t limit) const {
  // A newcomer is inside the recent window (so never the victim) whenever the window is non-empty.
  return policy_.recent_window > 0 && recent_count(limit) > 0;
}

std::size_t EvictionCore::admit(std::size_t head, std::size_t& n, const std::uint16_t* k, const std::uint16_t* v,
                                std::int64_t position, std::size_t limit, std::int64_t recent_threshold) {
  const auto place = [&](std::size_t slot) {
    if (k == nullptr) {
      write_metadata(head, slot, position, 0.0f);
    } else {
      write_row(head, slot, k, v, position, 0.0f);
    }
  };
  if (n < limit) {
    place(n);
    return n++;
  }
  // Over the limit: evict the lowest score among the stored rows and the newcomer (score 0,
  // highest position, so it loses every tie).
  const std::size_t victim = pick_victim(head, n, recent_threshold);
  if (drops_newcomer(newcomer_protected(limit), victim != kNone, victim != kNone ? effective_score(head, victim) : 0.0f)) {
    return kNone;
  }
  if (storage_->slot_writes()) {
    place(victim);
    return victim;
  }
  // A compressed storage takes rows at the end only: the victim leaves, the newcomer is appended
  // (a placed newcomer, right after the kept rows, moves down with them).
  const std::size_t one[1] = {victim};
  erase_rows(head, n, one);
  place(n - 1);
  return n - 1;
}

std::size_t EvictionCore::admit_in_order(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                                         const std::int64_t* positions, std::size_t S, std::size_t limit,
                                         const std::int64_t* recent_threshold) {
  // Rows by id: id < n0 the row held in slot id, n0 + s the call's token s. Token by token, the
  // admission of absorb_head_sequential / absorb_head_placed (admit(), scoring none): below the
  // limit a token is appended; at the limit the lowest (score, position) among the rows after the
  // sinks below the token's threshold leaves and the token comes in (or the token is dropped). The
  // thresholds only rise (in_order_call_), so a row, once below one, stays a candidate: candidates
  // enter a heap in position order instead of a scan of every row per token. Then the outcome is
  // applied at once (one erasure, or each token's final slot).
  const std::size_t n0 = rows_, D = dim_;
  const bool placed = keys16 == nullptr, slots = storage_->slot_writes(), protect = newcomer_protected(limit);
  const std::int64_t* held_pos = positions_.data() + head * capacity_;
  const auto pos_of = [&](std::size_t id) { return id < n0 ? held_pos[id] : positions[id - n0]; };
  std::vector<float> token_score(S, 0.0f);  // the bootstrap token's 1.0, else 0
  const auto score_of = [&](std::size_t id) { return id < n0 ? effective_score(head, id) : token_score[id - n0]; };
  struct Candidate {
    float score;
    std::int64_t pos;
    std::size_t id;
  };
  const auto higher = [](const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.pos > b.pos);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(higher)> candidates(higher);
  // The rows after the sinks not yet below a threshold, in position order: the held ones by position
  // (slot storages keep them in any order), then each token admitted.
  std::vector<std::size_t> waiting;
  waiting.reserve(n0 + S);
  for (std::size_t id = std::min(policy_.n_sink, n0); id < n0; ++id) waiting.push_back(id);
  const auto by_position = [&](std::size_t a, std::size_t b) { return held_pos[a] < held_pos[b]; };
  if (!std::is_sorted(waiting.begin(), waiting.end(), by_position)) {
    std::stable_sort(waiting.begin(), waiting.end(), by_position);
  }
  std::size_t next_waiting = 0;
  std::vector<std::uint8_t> alive(n0 + S, 0);
  std::vector<std::size_t> slot_of(n0 + S, kNone);  // slot storages: where each row ends up
  std::fill(alive.begin(), alive.begin() + static_cast<std::ptrdiff_t>(n0), 1);
  for (std::size_t id = 0; id < n0; ++id) slot_of[id] = id;
  std::size_t n = n0;
  for (std::size_t s = 0; s < S; ++s) {
    const std::size_t id = n0 + s;
    if (n < limit || n == 0) {  // appended (the first token ever: the bootstrap row, score 1.0)
      if (n == 0) token_score[s] = 1.0f;
      alive[id] = 1;
      slot_of[id] = n;
      if (n >= policy_.n_sink) waiting.push_back(id);
      ++n;
      continue;
    }
    for (; next_waiting < waiting.size() && pos_of(waiting[next_waiting]) < recent_threshold[s]; ++next_waiting) {
      const std::size_t w = waiting[next_waiting];
      if (alive[w]) candidates.push(Candidate{score_of(w), pos_of(w), w});
    }
    const bool has_victim = !candidates.empty();
    if (drops_newcomer(protect, has_victim, has_victim ? candidates.top().score : 0.0f)) continue;
    const std::size_t victim = candidates.top().id;
    candidates.pop();
    alive[victim] = 0;
    alive[id] = 1;
    slot_of[id] = slot_of[victim];  // (slot storages: the token takes the victim's slot)
    waiting.push_back(id);
  }
  const auto token = [&](std::size_t s, const std::uint16_t* base) { return base + s * D; };  // (the head's [S, D])
  if (!slots) {
    // Rows in arrival order: the held ones left, then the tokens admitted, each in its order.
    std::vector<std::size_t> gone;
    if (placed) {  // the storage holds [held | the call's tokens]: one erasure of every row that left
      for (std::size_t s = 0; s < S; ++s) write_metadata(head, n0 + s, positions[s], token_score[s]);
      for (std::size_t id = 0; id < n0 + S; ++id) {
        if (!alive[id]) gone.push_back(id);
      }
      if (!gone.empty()) erase_rows(head, n0 + S, gone);
      return n;
    }
    for (std::size_t id = 0; id < n0; ++id) {
      if (!alive[id]) gone.push_back(id);
    }
    if (!gone.empty()) erase_rows(head, n0, gone);
    std::size_t at = n0 - gone.size();
    for (std::size_t s = 0; s < S; ++s) {
      if (alive[n0 + s]) write_row(head, at++, token(s, keys16), token(s, values16), positions[s], token_score[s]);
    }
    return n;
  }
  // Slot storages: each token admitted in its final slot (a placed one moved there from where it
  // arrived; no final slot is another's arrival: those above the limit are never a victim's).
  for (std::size_t s = 0; s < S; ++s) {
    if (!alive[n0 + s]) continue;
    const std::size_t slot = slot_of[n0 + s];
    if (placed) {
      if (slot != n0 + s) storage_->move(head, n0 + s, slot);
      write_metadata(head, slot, positions[s], token_score[s]);
    } else {
      write_row(head, slot, token(s, keys16), token(s, values16), positions[s], token_score[s]);
    }
  }
  return n;
}

std::size_t EvictionCore::absorb_head_placed(std::size_t head, const std::int64_t* positions, std::size_t S,
                                             std::size_t limit, const std::int64_t* recent_threshold) {
  std::size_t n = rows_;
  for (std::size_t s = 0; s < S; ++s) {
    const std::size_t arrived = rows_ + s;
    std::size_t slot = 0;
    if (n == 0) {  // bootstrap, as absorb_head_sequential: the first token scores 1.0
      write_metadata(head, 0, positions[s], 1.0f);
      n = 1;
    } else {
      slot = admit(head, n, nullptr, nullptr, positions[s], limit, recent_threshold[s]);
    }
    if (!storage_->slot_writes()) {
      // The kept rows, then this call's rows from token s on (earlier ones admitted or erased):
      // a dropped newcomer lies at n.
      if (slot == kNone) {
        const std::size_t one[1] = {n};
        storage_->erase(head, one);
      }
      continue;
    }
    if (slot != kNone && slot != arrived) storage_->move(head, arrived, slot);
  }
  return n;
}

std::size_t EvictionCore::absorb_head_sequential(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                                                 const std::int64_t* positions, std::size_t S, std::size_t limit,
                                                 const std::int64_t* recent_threshold, AbsorbScratch& scratch) {
  const std::size_t D = dim_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::size_t n = rows_;
  float* scores = scores_.data() + head * capacity_;
  for (std::size_t s = 0; s < S; ++s) {
    const std::uint16_t* k = keys16 + s * D;
    const std::uint16_t* v = values16 + s * D;
    if (n == 0) {  // bootstrap: the first token scores 1.0 and is never checked against the budget
      write_row(head, 0, k, v, positions[s], 1.0f);
      n = 1;
      continue;
    }
    if (scoring() == Scoring::key_proxy) {
      if (policy_.decay != 1.0f) {
        for (std::size_t j = 0; j < n; ++j) scores[j] *= policy_.decay;
      }
      // The fp16-rounded incoming key is the query; softmax in fp32 over the stored rows.
      convert_fp16_to_f32(k, scratch.query.data(), D);
      storage_->key_logits(head, n, scratch.query.data(), scratch.logits.data());
      kernels::softmax_accumulate(scratch.logits.data(), n, scale, scores);
    }
    admit(head, n, k, v, positions[s], limit, recent_threshold[s]);
  }
  return n;
}

std::size_t EvictionCore::absorb_head_blocked(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                                              const std::int64_t* positions, std::size_t S, std::size_t limit,
                                              const std::int64_t* recent_threshold, AbsorbScratch& scratch) {
  // The same token-by-token semantics as absorb_head_sequential (each token's key attends over
  // the rows stored when it arrives, then the eviction), with the dot products batched per block
  // of kBlockTokens incoming keys: one multi-query pass over a transposed fp32 copy of the rows
  // stored at the block's start (kt), one for the block's keys against each other; each token then
  // reads its row of the first and patches the slots the block itself wrote from the second. Only
  // the summation order of the dot products differs from the sequential path.
  const std::size_t D = dim_, B = kBlockTokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::size_t ld = kernels::padded_columns(capacity_);
  if (scratch.kt.size() < D * ld) scratch.kt.resize(D * ld);                      // [D, ld] column i = slot i
  if (scratch.block_logits.size() < B * ld) scratch.block_logits.resize(B * ld);  // [B, ld]
  scratch.block_queries.resize(B * D);   // [B, D] the block's keys, fp32
  scratch.block_keys_t.resize(D * B);    // [D, B] the same, transposed
  scratch.block_self.resize(B * B);      // [B, B] block key b . block key b'
  scratch.source.resize(capacity_);      // [capacity] the block token a slot holds, or -1
  scratch.touched.clear();               // slots the block wrote, each once
  if (scratch.logits.size() < ld) scratch.logits.resize(ld);
  float* kt = scratch.kt.data();
  float* bq = scratch.block_queries.data();
  std::size_t n = rows_;
  float* scores = scores_.data() + head * capacity_;
  for (std::size_t i = 0; i < n; ++i) {  // rows stored before this call (a prefill starts empty)
    convert_fp16_to_f32(storage_->fp16_key(head, i), scratch.query.data(), D);
    for (std::size_t j = 0; j < D; ++j) kt[j * ld + i] = scratch.query[j];
  }
  std::fill_n(scratch.source.begin(), capacity_, -1);
  for (std::size_t s0 = 0; s0 < S; s0 += B) {
    const std::size_t nb = std::min(B, S - s0);
    convert_fp16_to_f32(keys16 + s0 * D, bq, nb * D);
    for (std::size_t b = 0; b < nb; ++b) {
      for (std::size_t j = 0; j < D; ++j) scratch.block_keys_t[j * B + b] = bq[b * D + j];
    }
    const std::size_t n0 = n;
    if (n0 > 0) kernels::dot_columns_f32(kt, ld, n0, D, bq, nb, scratch.block_logits.data(), ld);
    kernels::dot_columns_f32(scratch.block_keys_t.data(), B, nb, D, bq, nb, scratch.block_self.data(), B);
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t s = s0 + b;
      const std::uint16_t* k = keys16 + s * D;
      const std::uint16_t* v = values16 + s * D;
      std::size_t slot = kNone;
      if (n == 0) {  // bootstrap, as in the sequential path
        write_row(head, 0, k, v, positions[s], 1.0f);
        slot = n++;
      } else {
        if (policy_.decay != 1.0f) {
          for (std::size_t j = 0; j < n; ++j) scores[j] *= policy_.decay;
        }
        float* logits = scratch.logits.data();
        std::memcpy(logits, scratch.block_logits.data() + b * ld, std::min(n, n0) * sizeof(float));
        const float* self = scratch.block_self.data() + b * B;
        for (const std::size_t t : scratch.touched) logits[t] = self[scratch.source[t]];
        kernels::softmax_accumulate(logits, n, scale, scores);
        slot = admit(head, n, k, v, positions[s], limit, recent_threshold[s]);
      }
      if (slot != kNone) {
        if (scratch.source[slot] < 0) scratch.touched.push_back(slot);
        scratch.source[slot] = static_cast<int>(b);
      }
    }
    // The block's surviving keys join kt (dimension-major: the writes of each row of kt stay
    // together), and the slots become plain stored rows for the next block.
    for (std::size_t j = 0; j < D; ++j) {
      float* row = kt + j * ld;
      const float* keys_t = scratch.block_keys_t.data() + j * B;
      for (const std::size_t t : scratch.touched) row[t] = keys_t[scratch.source[t]];
    }
    for (const std::size_t t : scratch.touched) scratch.source[t] = -1;
    scratch.touched.clear();
  }
  return n;
}

void EvictionCore::write_row(std::size_t head, std::size_t slot, const std::uint16_t* k, const std::uint16_t* v,
                             std::int64_t position, float score) {
  storage_->write(head, slot, k, v);
  write_metadata(head, slot, position, score);
  if (!weight_.empty()) weight_[head * capacity_ + slot] = policy_.row_weight(k, v, dim_);
}

void EvictionCore::write_metadata(std::size_t head, std::size_t slot, std::int64_t position, float score) {
  const std::size_t row = head * capacity_ + slot;
  positions_[row] = position;
  scores_[row] = score;
  if (!exposure_.empty()) exposure_[row] = 0.0f;
}

void EvictionCore::move_row(std::size_t head, std::size_t from, std::size_t to) {
  storage_->move(head, from, to);
  move_metadata(head, from, to);
}

void EvictionCore::erase_rows(std::size_t head, std::size_t n, std::span<const std::size_t> slots) {
  storage_->erase(head, slots);
  std::size_t to = slots.empty() ? n : slots[0], next = 0;
  for (std::size_t from = to; from < n; ++from) {
    if (next < slots.size() && slots[next] == from) {
      ++next;
      continue;
    }
    move_metadata(head, from, to++);
  }
}

void EvictionCore::move_metadata(std::size_t head, std::size_t from, std::size_t to) {
  const std::size_t src = head * capacity_ + from, dst = head * capacity_ + to;
  positions_[dst] = positions_[src];
  scores_[dst] = scores_[src];
  if (!exposure_.empty()) exposure_[dst] = exposure_[src];
  if (!weight_.empty()) weight_[dst] = weight_[src];
}

float EvictionCore::effective_score(std::size_t head, std::size_t slot) const {
  const std::size_t row = head * capacity_ + slot;
  if (scoring() == Scoring::attention_normalized) {
    return exposure_[row] > 0.0f ? scores_[row] / exposure_[row] : 0.0f;
  }
  return scores_[row];
}

std::size_t EvictionCore::pick_victim(std::size_t head, std::size_t n, std::int64_t recent_threshold) const {
  const std::int64_t* pos = positions_.data() + head * capacity_;
  std::size_t best = kNone;
  float best_score = 0.0f;
  for (std::size_t j = policy_.n_sink; j < n; ++j) {
    if (pos[j] >= recent_threshold) continue;
    const float s = effective_score(head, j);
    if (best == kNone || s < best_score || (s == best_score && pos[j] < pos[best])) {
      best = j;
      best_score = s;
    }
  }
  return best;
}

bool EvictionCore::owner_may_admit(std::size_t limit, std::int64_t position) const {
  // A newcomer after every position the window saw is the window's newest, so at or above its
  // threshold: never the victim, as absorb() never picks it either.
  return scoring() == Scoring::none && policy_.row_weight == nullptr && batch_ > 0 &&
         limit != EvictionPolicy::kUnbounded && rows_ == limit && limit > policy_.n_sink &&
         newcomer_protected(limit) && position > newest_;
}

std::int64_t EvictionCore::admit_by_owner(std::int64_t position, std::size_t limit) {
  if (!owner_may_admit(limit, position)) {
    throw std::logic_error("eviction core: an owner admits a row only for scoring none at the limit, after every "
                           "position held (position " + std::to_string(position) + ")");
  }
  recent_.push_back(position);
  newest_ = position;
  if (recent_.size() > policy_.recent_window) recent_.pop_front();
  last_limit_ = limit;
  return recent_threshold(limit);
}

void EvictionCore::observed_by_owner(std::size_t rows, std::size_t limit) {
  if (rows > rows_) throw std::logic_error("eviction core: an owner's observation cannot add rows");
  awaiting_observation_ = false;
  last_limit_ = limit;
  rows_ = rows;
}

void EvictionCore::observe(const AttentionObservation& obs, std::size_t limit, const std::string& who) {
  if (fallback_) return;  // scored by the key proxy since an update went unobserved
  if (obs.batch != batch_ || obs.heads != heads_ || obs.tokens != rows_ || obs.probs == nullptr ||
      obs.stride < obs.tokens || (!obs.query_positions.empty() && obs.query_positions.size() != obs.queries)) {
    throw InputError("attention observation [" + std::to_string(obs.batch) + ", " + std::to_string(obs.heads) + ", " +
                     std::to_string(obs.queries) + ", " + std::to_string(obs.tokens) + "] does not match the view [" +
                     std::to_string(batch_) + ", " + std::to_string(heads_) + ", q, " + std::to_string(rows_) +
                     "] of the last update_and_fetch");
  }
  check_observation_finite(obs, who);  // after the shape check: it reads every weight
  awaiting_observation_ = false;
  last_limit_ = limit;
  const bool normalized = policy_.scoring == Scoring::attention_normalized;
  // A multi-query observation (a prefill call) exchanges importance with the other layers.
  const bool prefill = obs.queries > 1;
  const bool exchange = prefill && board_ != nullptr && policy_.cross_layer > 0.0f && board_->join(board_layer_, prefill_calls_);
  if (prefill) ++prefill_calls_;
  if (prior_ != nullptr && obs.queries > 1 && prior_->heads != heads_total()) {
    if (exchange) board_->leave(board_layer_, /*publish=*/false);
    throw InputError("prior scores for " + std::to_string(prior_->heads) + " heads given to a cache of " +
                     std::to_string(heads_total()));
  }
  // Each head scores alone (its rows, its scratch; the board's reads exclude this layer's own
  // posts and keep maxima, so the order heads post in changes nothing): a prompt's window over
  // many heads is split across threads.
  auto observe_heads = [&](std::size_t begin, std::size_t end, ObserveScratch& sc) {
    for (std::size_t head = begin; head < end; ++head) {
      const float factor = observation_contribution(obs, head, sc);
      float* scores = scores_.data() + head * capacity_;
      if (factor != 1.0f) {
        for (std::size_t i = 0; i < rows_; ++i) scores[i] *= factor;
      }
      kernels::add_f32(sc.pooled.data(), rows_, scores);
      if (normalized) {
        float* exposure = exposure_.data() + head * capacity_;
        for (std::size_t i = 0; i < rows_; ++i) exposure[i] = exposure[i] * factor + sc.exposure[i];
      }
      if (exchange) exchange_importance(head, sc);
    }
  };
  const std::size_t total = heads_total();
  const double work = static_cast<double>(total) * static_cast<double>(rows_) *
                      static_cast<double>(std::min<std::size_t>(obs.queries, policy_.obs_window > 0 ? policy_.obs_window : obs.queries));
  // One scratch per thread split_heads may use; a decode step's small observation uses one.
  observe_scratch_.resize(work < kObserveThreadWork ? 1 : kMaxObserveThreads);
  try {
    split_heads(total, work, [&](std::size_t begin, std::size_t end, std::size_t t) { observe_heads(begin, end, observe_scratch_[t]); });
  } catch (...) {
    if (exchange) board_->leave(board_layer_, /*publish=*/false);
    throw;
  }
  observe_scratch_.resize(1);  // the other threads' scratch served one prompt: not kept
  if (exchange) board_->leave(board_layer_);
  if (prefill) prior_.reset();  // used by this prefill (kvslim/prior_scores.h): the next sequence attaches its own
  if (rows_ > limit) drop_lowest(rows_ - limit);
  // A prefill appended the whole prompt before this eviction: give back what the budget (plus the
  // one row a decode step appends before it is observed) does not need.
  if (limit != EvictionPolicy::kUnbounded && capacity_ > limit + 1 + limit / 8) relayout(std::max(rows_, limit + 1));
  settle();
}

bool EvictionCore::begin_owner_prompt(const AttentionObservation& obs, const std::string& who) {
  if (!owner_may_score_prompt() || obs.queries < 2) throw std::logic_error("eviction core: " + who + ": no owner scores this observation");
  if (obs.batch != batch_ || obs.heads != heads_ || obs.tokens != rows_ || obs.probs == nullptr || obs.stride < obs.tokens ||
      (!obs.query_positions.empty() && obs.query_positions.size() != obs.queries)) {
    throw InputError("attention observation [" + std::to_string(obs.batch) + ", " + std::to_string(obs.heads) + ", " +
                     std::to_string(obs.queries) + ", " + std::to_string(obs.tokens) + "] does not match the view [" +
                     std::to_string(batch_) + ", " + std::to_string(heads_) + ", q, " + std::to_string(rows_) +
                     "] of the last update_and_fetch");
  }
  awaiting_observation_ = false;
  const bool exchange = board_ != nullptr && policy_.cross_layer > 0.0f && board_->join(board_layer_, prefill_calls_);
  ++prefill_calls_;
  return exchange;
}

void EvictionCore::end_owner_prompt(bool exchanged, std::size_t limit, bool dropped) {
  if (exchanged) board_->leave(board_layer_);  // nothing pending here: the owner posted on its own board
  prior_.reset();
  last_limit_ = limit;
  if (rows_ > limit) {
    if (dropped) {
      rows_ = limit;
    } else {
      drop_lowest(rows_ - limit);
    }
  }
  if (limit != EvictionPolicy::kUnbounded && capacity_ > limit + 1 + limit / 8) relayout(std::max(rows_, limit + 1));
  settle();
}

float EvictionCore::observation_contribution(const AttentionObservation& obs, std::size_t head, ObserveScratch& sc) const {
  const bool normalized = policy_.scoring == Scoring::attention_normalized;
  const std::size_t n = rows_, Q = obs.queries;
  // Observation window: only the last obs_window queries of a long observation (the end of a
  // prompt, where the question is) score the rows.
  const std::size_t first = policy_.obs_window > 0 && Q > policy_.obs_window ? Q - policy_.obs_window : 0;
  sc.contribution.assign(n, 0.0f);
  if (normalized) sc.exposure.assign(n, 0.0f);
  const std::int64_t* pos = positions_.data() + head * capacity_;
  float weight = 1.0f;  // decay^(queries after q)
  sc.window_queries = Q - first;
  for (std::size_t q = Q; q-- > first;) {
    const float* p = obs.probs + (head * Q + q) * obs.stride;
    if (weight == 1.0f) {
      kernels::add_f32(p, n, sc.contribution.data());
    } else {
      for (std::size_t i = 0; i < n; ++i) sc.contribution[i] += weight * p[i];
    }
    if (normalized) {
      const std::int64_t qpos = obs.query_positions.empty() ? std::numeric_limits<std::int64_t>::max() : obs.query_positions[q];
      for (std::size_t i = 0; i < n; ++i) sc.exposure[i] += pos[i] <= qpos ? weight : 0.0f;
    }
    weight *= policy_.decay;
  }
  if (!weight_.empty()) {  // a registered score: the row's own weight times its attention
    const float* w = weight_.data() + head * capacity_;
    for (std::size_t i = 0; i < n; ++i) sc.contribution[i] *= w[i];
  }
  // The prior hook (kvslim/prior_scores.h, issue 27): a prefill's window ranks rows by what the
  // prompt's last queries attended, which is the question only when the question is inside the
  // prompt. A prior (e.g. reconstruction scores) adds, per row, weight x its importance as
  // attention per window query (the unit the window's own mean is in), before pooling, so the
  // recent window, sinks, pooling and cross-layer exchange treat it as the window's own signal.
  if (prior_ != nullptr && Q > 1) {  // observe() checked its heads
    const float w = prior_->weight;
    for (std::size_t i = 0; i < n; ++i) {
      const float seen = normalized ? sc.exposure[i] : static_cast<float>(sc.window_queries);
      sc.contribution[i] += w * prior_->at(head, pos[i]) * seen;
    }
  }
  // Pooling over position neighbours, for multi-query observations (a prefill) only: a decode
  // step's single query scores exactly what it attended (and stays O(rows) per step).
  const std::size_t half = policy_.pool_kernel / 2;
  if (half == 0 || Q < 2 || n < 2) {
    sc.pooled.swap(sc.contribution);
    return weight;
  }
  order_by_position(head, sc);
  // Normalised scoring pools the mean attention per query that saw the row (so a token right
  // after a hot one is not inflated by its smaller exposure), then weighs it back by the exposure.
  if (normalized) {
    for (std::size_t i = 0; i < n; ++i) {
      sc.contribution[i] = sc.exposure[i] > 0.0f ? sc.contribution[i] / sc.exposure[i] : 0.0f;
    }
  }
  sc.pooled.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    float m = 0.0f;
    for (std::size_t t = j > half ? j - half : 0; t <= std::min(n - 1, j + half); ++t) m = std::max(m, sc.contribution[sc.order[t]]);
    sc.pooled[sc.order[j]] = m;
  }
  if (normalized) {
    for (std::size_t i = 0; i < n; ++i) sc.pooled[i] *= sc.exposure[i];
  }
  return weight;
}

void EvictionCore::order_by_position(std::size_t head, ObserveScratch& sc) const {
  const std::int64_t* pos = positions_.data() + head * capacity_;
  const std::size_t n = rows_;
  sc.order.resize(n);
  for (std::size_t i = 0; i < n; ++i) sc.order[i] = i;
  // Rows are in position order unless an eviction reused a slot: sort only then.
  auto earlier = [&](std::size_t a, std::size_t b) { return pos[a] < pos[b]; };
  if (!std::is_sorted(sc.order.begin(), sc.order.end(), earlier)) std::sort(sc.order.begin(), sc.order.end(), earlier);
}

void EvictionCore::exchange_importance(std::size_t head, ObserveScratch& sc) {
  const std::size_t n = rows_;
  const bool normalized = policy_.scoring == Scoring::attention_normalized;
  if (policy_.pool_kernel < 3 || n < 2) order_by_position(head, sc);  // else observation_contribution sorted them
  const std::int64_t* pos = positions_.data() + head * capacity_;
  float* scores = scores_.data() + head * capacity_;
  sc.board_positions.resize(n);
  sc.board_values.resize(n);
  sc.own_values.resize(n);
  sc.board_seen.resize(n);
  // This observation's importance of a row: its (pooled) attention per window query that saw it.
  // sc.pooled holds that mean times the row's exposure when normalised, the window's sum otherwise.
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = sc.order[k];
    const float seen = normalized ? sc.exposure[i] : static_cast<float>(sc.window_queries);
    sc.board_positions[k] = pos[i];
    sc.board_seen[k] = seen;
    sc.own_values[k] = seen > 0.0f ? sc.pooled[i] / seen : 0.0f;
  }
  const std::size_t batch_row = head / heads_;
  board_->read(board_layer_, batch_row, sc.board_positions.data(), n, sc.board_values.data());
  // Another layer's importance counts as attention these queries paid (the same weight per query).
  for (std::size_t k = 0; k < n; ++k) scores[sc.order[k]] += policy_.cross_layer * sc.board_values[k] * sc.board_seen[k];
  board_->post(board_layer_, batch_row, sc.board_positions.data(), sc.own_values.data(), n);
}

void EvictionCore::share_importance(std::shared_ptr<CrossLayerImportance> board, std::size_t layer) {
  board_ = std::move(board);
  board_layer_ = layer;
}

void EvictionCore::choose_holes(std::size_t head, std::size_t drop, std::int64_t threshold, std::vector<Ranked>& ranked,
                                std::vector<std::size_t>& holes) const {
  holes.clear();
  if (drop == 1) {
    const std::size_t victim = pick_victim(head, rows_, threshold);
    if (victim == kNone) throw std::logic_error("eviction core: no evictable row to drop");
    holes.push_back(victim);
    return;
  }
  // Each candidate's effective score once (not in every comparison); lowest first, ties: lower
  // position (positions are distinct: the order is total, so the chosen set is unique).
  const std::int64_t* pos = positions_.data() + head * capacity_;
  ranked.clear();
  for (std::size_t j = policy_.n_sink; j < rows_; ++j) {
    if (pos[j] < threshold) ranked.push_back(Ranked{effective_score(head, j), pos[j], j});
  }
  if (ranked.size() < drop) throw std::logic_error("eviction core: fewer evictable rows than must go");
  std::nth_element(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(drop - 1), ranked.end(),
                   [](const Ranked& a, const Ranked& b) { return a.score < b.score || (a.score == b.score && a.position < b.position); });
  for (std::size_t i = 0; i < drop; ++i) holes.push_back(ranked[i].slot);
  std::sort(holes.begin(), holes.end());
}

void EvictionCore::drop_lowest(std::size_t drop) {
  const std::int64_t threshold = recent_threshold(rows_ - drop);
  const std::size_t total = heads_total();
  // Which rows leave is each head's own choice (threads share a prompt's many heads); the storage
  // then moves them head after head.
  if (holes_.size() < total) holes_.resize(total);
  if (ranked_.size() < total) ranked_.resize(total);
  const double work = drop > 1 ? static_cast<double>(total) * static_cast<double>(rows_) * 16.0 : 0.0;
  split_heads(total, work, [&](std::size_t begin, std::size_t end, std::size_t) {
    for (std::size_t head = begin; head < end; ++head) choose_holes(head, drop, threshold, ranked_[head], holes_[head]);
  });
  for (std::size_t head = 0; head < total; ++head) {
    const std::vector<std::size_t>& holes = holes_[head];
    if (!storage_->slot_writes()) {  // a compressed storage: the others keep their order
      erase_rows(head, rows_, holes);
      continue;
    }
    // Fill each hole with the last live row: O(drop * D) moves, sinks (the leading slots) stay put.
    std::size_t last = rows_;  // one past the last candidate for moving
    std::size_t tail_hole = holes.size();
    for (std::size_t h = 0; h < holes.size(); ++h) {
      const std::size_t hole = holes[h];
      while (last > 0 && tail_hole > h && holes[tail_hole - 1] == last - 1) {
        --tail_hole;  // the row at the end is itself a hole: skip it
        --last;
      }
      if (h >= tail_hole || last == 0 || last - 1 <= hole) break;
      move_row(head, last - 1, hole);
      --last;
    }
  }
  rows_ -= drop;
  if (drop > 1) {  // a prompt's candidates and holes (every row of every head) are not kept between calls
    ranked_.clear();
    holes_.clear();
  }
}

void EvictionCore::split_heads(std::size_t total, double work,
                               const std::function<void(std::size_t, std::size_t, std::size_t)>& task) {
  const std::size_t threads =
      work < kObserveThreadWork
          ? 1
          : std::min<std::size_t>({total, kMaxObserveThreads, std::max<std::size_t>(1, std::thread::hardware_concurrency())});
  if (threads <= 1) {
    task(0, total, 0);
    return;
  }
  std::vector<std::exception_ptr> errors(threads);
  std::vector<std::thread> workers;
  auto run = [&](std::size_t t) {
    try {
      task(total * t / threads, total * (t + 1) / threads, t);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  for (std::size_t t = 1; t < threads; ++t) workers.emplace_back(run, t);
  run(0);
  for (std::thread& w : workers) w.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

std::vector<float> EvictionCore::evictable_scores(std::size_t limit, std::size_t& protected_rows) const {
  const std::int64_t threshold = recent_threshold(limit);
  std::vector<float> out;
  std::size_t evictable = 0;
  for (std::size_t head = 0; head < heads_total(); ++head) {
    const std::int64_t* pos = positions_.data() + head * capacity_;
    evictable = 0;
    for (std::size_t j = policy_.n_sink; j < rows_; ++j) {
      if (pos[j] >= threshold) continue;
      out.push_back(effective_score(head, j));
      ++evictable;
    }
  }
  protected_rows = rows_ - evictable;
  return out;
}

void EvictionCore::trim(std::size_t budget) {
  if (rows_ > budget) drop_lowest(rows_ - budget);
  // Give back what the kept rows do not need (a deferred prefill may have held the whole prompt).
  const std::size_t keep = std::max(rows_, std::min(capacity_, budget));
  if (capacity_ > keep) relayout(keep);
  settle();
}

void EvictionCore::trimmed_by_owner(std::size_t budget) {
  if (rows_ > budget) rows_ = budget;
  const std::size_t keep = std::max(rows_, std::min(capacity_, budget));
  if (capacity_ > keep) relayout(keep);
  settle();
}

void EvictionCore::reserve_rows(std::size_t needed, std::size_t bound) {
  if (needed <= capacity_) return;
  // x1.5: O(log n) moves over n appended rows, at most half the kept rows allocated and unused; a
  // reserve() hint that covers what is needed is taken whole instead (no move at all).
  std::size_t grown = std::max<std::size_t>(16, capacity_ + capacity_ / 2);
  if (reserve_hint_ >= needed) grown = std::max(grown, reserve_hint_);
  relayout(std::max(needed, std::min(grown, bound)));
}

void EvictionCore::relayout(std::size_t new_capacity) {
  const std::size_t total = heads_total();
  const bool normalized = scoring() == Scoring::attention_normalized;
  UninitBuffer<float> scores(total * new_capacity);
  UninitBuffer<float> exposure(normalized ? total * new_capacity : 0);
  UninitBuffer<float> weights(policy_.row_weight != nullptr ? total * new_capacity : 0);
  UninitBuffer<std::int64_t> positions(total * new_capacity);
  const std::size_t keep = std::min(rows_, new_capacity);
  for (std::size_t head = 0; head < total; ++head) {
    const std::size_t src = head * capacity_, dst = head * new_capacity;
    if (keep == 0) continue;
    std::memcpy(scores.data() + dst, scores_.data() + src, keep * sizeof(float));
    std::memcpy(positions.data() + dst, positions_.data() + src, keep * sizeof(std::int64_t));
    if (!exposure.empty()) std::memcpy(exposure.data() + dst, exposure_.data() + src, keep * sizeof(float));
    if (!weights.empty()) std::memcpy(weights.data() + dst, weight_.data() + src, keep * sizeof(float));
  }
  storage_->relayout(new_capacity, keep);
  scores_ = std::move(scores);
  exposure_ = std::move(exposure);
  weight_ = std::move(weights);
  positions_ = std::move(positions);
  capacity_ = new_capacity;
}

void EvictionCore::reset() {
  batch_ = heads_ = dim_ = 0;
  capacity_ = rows_ = head_rows_ = 0;
  storage_->reset();
  scores_.release();
  exposure_.release();
  weight_.release();
  positions_.release();
  recent_.clear();
  newest_ = std::numeric_limits<std::int64_t>::min();
  prefill_calls_ = 0;
  last_limit_ = kNone;
  awaiting_observation_ = fallback_ = false;
}

CacheView EvictionCore::view() const {
  CacheView v = storage_->view(batch_, heads_, rows_, positions_.data(), capacity_);
  v.batch = batch_;
  v.heads = heads_;
  v.head_dim = dim_;
  return v;
}

std::size_t EvictionCore::resident_bytes() const {
  return storage_->resident_bytes() + scores_.bytes() + exposure_.bytes() + weight_.bytes() + positions_.bytes();
}

}  // namespace kvslim
