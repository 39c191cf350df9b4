// The H2O eviction core shared by h2o, squeeze, pyramidkv, streaming and full: the policy half of
// "a cache is a policy over a storage". Per head it keeps each row's true position and cumulative
// score (the metadata, in slot order) and decides which rows arrive and which leave; the rows
// themselves live in a RowStorage (storage/row_storage.h: fp16 slots, kivi codes, zipcache mixed
// precision) that the core never reads except through key_logits for the key-proxy score. A method
// is a policy over this core (a score, a budget, protected rows), never a copy of it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cross_layer_importance.h"
#include "storage/row_storage.h"
#include "kvslim/cache.h"
#include "kvslim/prior_scores.h"
#include "uninit_buffer.h"

namespace kvslim {

enum class Scoring {
  none,                  // position only (streaming, full): the oldest evictable row goes first
  key_proxy,             // documented H2O-adapted: the incoming key is the query
  attention,             // real attention mass from the engine (observe)
  attention_normalized,  // that mass divided by how many queries could see the row
};
Scoring parse_scoring(const std::string& name);
// True for the scorings that wait for the engine's attention (observe) instead of the key proxy.
inline bool scores_by_attention(Scoring s) { return s == Scoring::attention || s == Scoring::attention_normalized; }

struct EvictionPolicy {
  static constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();
  std::size_t n_sink = 0;         // the first n_sink rows ever absorbed are never evicted
  std::size_t recent_window = 0;  // the newest recent_window positions are never evicted
  // The recent window shrinks to half of (limit - n_sink) when the limit is small (the
  // query-aware profile: one window size for every layer budget); false: exactly recent_window.
  bool recent_fits_budget = false;
  Scoring scoring = Scoring::key_proxy;
  // Observation window (SnapKV): an observation of many queries (a prefill) scores the rows by
  // its last obs_window queries only; 0 = every query counts (the documented accumulation).
  std::size_t obs_window = 0;
  // Each observation's contribution is max-pooled over this many position neighbours (odd; 1 =
  // none), so a token next to an attended one (the rest of a number, a name) stays with it.
  std::size_t pool_kernel = 1;
  // Older attention counts less: every observed query multiplies the stored scores (and, for
  // attention_normalized, the exposure) by decay first; 1 = plain sum (the documented H2O).
  float decay = 1.0f;
  // A prefill observation also adds, per row, cross_layer x the importance other layers' queries
  // gave its position (CrossLayerImportance; needs share_importance). 0 = each layer alone.
  float cross_layer = 0.0f;
  // A registered score (cache/row_scores.h): each observation's attention of a row is multiplied
  // by row_weight(its key, its value) first. nullptr: the plain scoring.
  float (*row_weight)(const std::uint16_t* key, const std::uint16_t* value, std::size_t dim) = nullptr;
};

struct KVCacheConfig;
// Working memory of one absorbing thread (eviction_core.cc): taken from a process-wide pool, so
// that neither a decode step nor a new layer's first call allocates or first-touches it again.
struct AbsorbScratch;

// The eviction policy of an H2O-core method (h2o, squeeze, pyramidkv) from its config: the
// evict_* fields, with "auto" values filled in from evict_profile.
EvictionPolicy make_eviction_policy(const KVCacheConfig& config, int n_sink);
// StreamingLLM's policy (streaming): no scores; streaming_n_sink sinks and a recent window of the
// rest of streaming_budget, so the newest tokens stay.
EvictionPolicy make_streaming_policy(const KVCacheConfig& config);

class EvictionCore {
 public:
  // `storage` holds the rows (null: fp16 slots, make_fp16_storage()).
  explicit EvictionCore(EvictionPolicy policy, std::unique_ptr<RowStorage> storage = nullptr);

  // Absorbs S new tokens, fp16 [heads_total, S, D] (heads_total = batch * heads), with their
  // positions [S]. Rows never exceed `limit` per head: key_proxy and none evict one row per token
  // over the limit, in arrival order (each eviction sees the scores so far); attention scorings
  // only append (they evict in observe()). Pass EvictionPolicy::kUnbounded for no limit.
  void absorb(std::size_t batch, std::size_t heads, std::size_t dim, const std::uint16_t* keys16,
              const std::uint16_t* values16, const std::int64_t* positions, std::size_t S, std::size_t limit);
  // The same for rows the storage's owner has already placed at slots rows()..rows()+S-1 of every
  // head (a device storage's append kernel), reached through RowStorage::prepare, which the core
  // calls once it has made room for them: the core takes their metadata only. Attention scorings
  // append them; scoring none (streaming) admits them in arrival order as absorb() does: over slots
  // each admitted row moves (RowStorage::move) from where it arrived to the slot it takes; over a
  // storage without slot writes its victim is erased (the rows after it, the arrivals included,
  // move down in order) and a dropped newcomer is erased where it lies. The room above the limit
  // is given back afterwards. No registered row score, no key
  // proxy (it reads the rows), and never after an unobserved update (the fallback reads rows).
  void absorb_placed(std::size_t batch, std::size_t heads, std::size_t dim, const std::int64_t* positions,
                     std::size_t S, std::size_t limit);
  // Scoring none (streaming) at its limit, one decode row at a time, decided by an owner that
  // mirrors the metadata (the device's kivi codes): the owner places the row after the kept ones and
  // erases the victim absorb() would pick -- the oldest row after the sinks below the protection
  // threshold (every score 0; ties by position) -- so the newcomer is never the victim. It may while
  // the core holds exactly `limit` rows and the newcomer, after every position so far, falls in the
  // recent window (never dropped).
  bool owner_may_admit(std::size_t limit, std::int64_t position) const;
  // Records the newcomer's position (the recent window moves on) and returns the threshold at or
  // above which rows are protected for this admission; the owner then erases its victim and reports
  // the rows with observed_by_owner(limit, limit). Its mirror is the truth until it writes it back.
  std::int64_t admit_by_owner(std::int64_t position, std::size_t limit);
  // True after an attention-scored append whose attention has not been observed yet.
  bool awaiting_observation() const { return awaiting_observation_; }
  // An owner that mirrors the metadata and runs a single-query observation itself (the device
  // eviction kernel: observe()'s arithmetic for one query, then drop_lowest(1)) reports that it
  // did: the head now holds `rows` rows. The owner's mirror is the truth until it writes it back
  // (metadata()).
  void observed_by_owner(std::size_t rows, std::size_t limit);
  // The per-row metadata, [heads_total, stride] each, for an owner that mirrors it (device
  // eviction): written back into these before the core decides anything on the host again.
  struct Metadata {
    std::int64_t* positions;
    float* scores;
    float* exposure;  // attention_normalized only, else nullptr
    std::size_t stride;
  };
  Metadata metadata() {
    return {positions_.data(), scores_.data(), exposure_.empty() ? nullptr : exposure_.data(), capacity_};
  }
  // Positions at or above this are in the protected recent window, for a row limit `limit`.
  std::int64_t recent_threshold(std::size_t limit) const;
  // Adds the attention each row received (the policy's window, pooling and decay), then evicts
  // down to `limit` rows per head.
  // `who` names the cache in errors (a shape mismatch, a NaN or infinite weight: checked first).
  void observe(const AttentionObservation& obs, std::size_t limit, const std::string& who);
  // True after an attention-scored core saw an update that was never observed: it scores by the
  // key proxy from then on (an integrator that does not report attention still gets a bounded cache).
  bool fell_back() const { return fallback_; }
  // A registered score's per-row weights (policy_.row_weight) ride with the rows' metadata.
  bool has_row_weights() const { return !weight_.empty(); }
  // Keeps at most `budget` rows per head: lowest scores leave first (ties: lower position first);
  // sinks and the recent window always stay. Shrinks the allocation to what is kept.
  void trim(std::size_t budget);
  // trim(budget) whose drop an owner made itself (a device store chose and moved the rows that
  // leave, as drop_lowest would have): the core keeps `budget` rows, shrinks, settles. Its own
  // metadata is then the owner's to refresh before the core decides again. The settle hands the
  // storage saliency from that stale metadata: only a storage that ignores saliency at settle
  // (fp16 slots, kivi codes) may be trimmed this way (DeviceRowStore::drop_lowest_on_device).
  void trimmed_by_owner(std::size_t budget);
  // A prompt's observation (several queries) that an owner scores on its mirrors itself (the
  // device's prompt kernels, cuda/device_prompt_scoring.h: observation_contribution's arithmetic,
  // the pooling and the cross-layer exchange, then drop_lowest's choice). It may while the core
  // holds no row weights, no prior, and has not fallen back. begin: the observation's bookkeeping
  // (checked shape, the board joined); returns whether this layer exchanges with the board (the
  // owner then reads and posts on its own board, nothing on this one). end: `dropped` says whether
  // the owner also dropped the rows over `limit` (else the core drops them from its metadata, which
  // the owner has refreshed); then the core shrinks and settles as observe() does.
  bool owner_may_score_prompt() const { return !fallback_ && weight_.empty() && prior_ == nullptr; }
  bool begin_owner_prompt(const AttentionObservation& obs, const std::string& who);
  // Multi-query observations so far: the board's call index of the next one.
  std::size_t prefill_calls() const { return prefill_calls_; }
  void end_owner_prompt(bool exchanged, std::size_t limit, bool dropped);
  void reset();
  // Rows per head the caller expects at most: an unbounded core grows straight to it (no x1.5
  // steps); a bounded one never allocates past its limit anyway.
  void reserve(std::size_t rows) { reserve_hint_ = rows; }
  // Joins the model's cross-layer board as sharing layer number `layer` (used when
  // policy().cross_layer > 0 and the scoring is attention).
  void share_importance(std::shared_ptr<CrossLayerImportance> board, std::size_t layer);
  // While the head holds more than `rows` rows they may still be cut (squeeze before its schedule
  // exists): the storage keeps them as they are, so a later cut does not leave half-empty
  // compressed groups behind. kUnbounded: never held.
  void hold_compression_above(std::size_t rows) { hold_above_ = rows; }
  // Prior scores for the next multi-query observation (kvslim/prior_scores.h); released by it.
  // Kept across reset(): it is attached for the sequence that starts there.
  void attach_prior(std::shared_ptr<const PriorScores> prior) { prior_ = std::move(prior); }

  CacheView view() const;
  // Feeds head `head`'s rows to the attention in row order (KVCache::attend).
  void feed(attend::HeadAttention& ha, std::size_t head) const;
  std::size_t batch() const { return batch_; }
  std::size_t heads() const { return heads_; }
  std::size_t dim() const { return dim_; }
  const RowStorage& storage() const { return *storage_; }
  std::size_t rows() const { return rows_; }
  std::size_t heads_total() const { return batch_ * heads_; }
  std::size_t resident_bytes() const;
  // Row scores and positions of head index `head` (b * heads + h), `rows()` entries, slot order.
  const float* scores(std::size_t head) const { return scores_.data() + head * capacity_; }
  const std::int64_t* positions(std::size_t head) const { return positions_.data() + head * capacity_; }
  const EvictionPolicy& policy() const { return policy_; }
  // The effective scores of every head's rows that eviction to `limit` could drop (not sinks, not
  // in the recent window), heads one after another; `protected_rows` gets the rows per head that
  // stay whatever the scores (squeeze's global top-k budget rule).
  std::vector<float> evictable_scores(std::size_t limit, std::size_t& protected_rows) const;

 private:
  // Incoming tokens scored together by the blocked key proxy (a prefill; decode stays per token).
  static constexpr std::size_t kBlockTokens = 64;
  // Scoring none admits a call of at least this many tokens in one pass (admit_in_order).
  static constexpr std::size_t kOnePassTokens = 64;
  void absorb_heads(std::size_t head_begin, std::size_t head_end, const std::uint16_t* keys16,
                    const std::uint16_t* values16, const std::int64_t* positions, std::size_t S,
                    std::size_t limit, const std::int64_t* recent_threshold, AbsorbScratch& scratch);
  // One head's S tokens ([S, D] each), token by token; returns the rows the head ends with.
  std::size_t absorb_head_sequential(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                                     const std::int64_t* positions, std::size_t S, std::size_t limit,
                                     const std::int64_t* recent_threshold, AbsorbScratch& scratch);
  // Scoring none over rows placed at rows_ .. rows_ + S - 1 (absorb_placed): the same admission,
  // each admitted row moved to its slot (slot storages), or its victim erased before it (others).
  // Scoring none over a call whose positions rise past every position held (in_order_call_): the
  // same admission decided in one pass (a heap of the rows below the threshold) and applied at once.
  // keys16 / values16 null: placed rows. O((rows + S) log rows) a head instead of a scan per token.
  std::size_t admit_in_order(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                             const std::int64_t* positions, std::size_t S, std::size_t limit,
                             const std::int64_t* recent_threshold);
  std::size_t absorb_head_placed(std::size_t head, const std::int64_t* positions, std::size_t S, std::size_t limit,
                                 const std::int64_t* recent_threshold);
  // The same for the key proxy with the dot products batched per block of kBlockTokens.
  std::size_t absorb_head_blocked(std::size_t head, const std::uint16_t* keys16, const std::uint16_t* values16,
                                  const std::int64_t* positions, std::size_t S, std::size_t limit,
                                  const std::int64_t* recent_threshold, AbsorbScratch& scratch);
  // Takes a scored newcomer into a head holding n rows: appended below the limit, else in the slot
  // of the lowest-scored evictable row unless the newcomer itself is lowest. Returns the slot
  // written (n grows when appended) or kNone when the newcomer is dropped. k = v = nullptr: the
  // row is in the storage already (absorb_head_placed), only its metadata is written.
  std::size_t admit(std::size_t head, std::size_t& n, const std::uint16_t* k, const std::uint16_t* v,
                    std::int64_t position, std::size_t limit, std::int64_t recent_threshold);
  // True when the recent window protects every newcomer (it can never be the victim).
  bool newcomer_protected(std::size_t limit) const;
  void reserve_rows(std::size_t needed, std::size_t preferred);
  void relayout(std::size_t new_capacity);
  void write_row(std::size_t head, std::size_t slot, const std::uint16_t* k, const std::uint16_t* v,
                 std::int64_t position, float score);
  // write_row's metadata half (the rows of absorb_placed are in the storage already).
  void write_metadata(std::size_t head, std::size_t slot, std::int64_t position, float score);
  void move_row(std::size_t head, std::size_t from, std::size_t to);  // slot storages
  void move_metadata(std::size_t head, std::size_t from, std::size_t to);
  // Rows `slots` (ascending) of a head holding n leave, the others keep their order (storages
  // without slot writes); n is the head's row count before.
  void erase_rows(std::size_t head, std::size_t n, std::span<const std::size_t> slots);
  // After a step's eviction: the storage may compress what waited (storage/row_storage.h),
  // unless held (hold_compression_above).
  void settle();
  // The evictable row with the lowest score (ties: lowest position), or kNone.
  std::size_t pick_victim(std::size_t head, std::size_t n, std::int64_t recent_threshold) const;
  float effective_score(std::size_t head, std::size_t slot) const;
  // Drops `drop` evictable rows of every head (lowest effective score first), compacting.
  void drop_lowest(std::size_t drop);
  struct Ranked;
  // The slots (ascending) of head `head` that drop_lowest removes.
  void choose_holes(std::size_t head, std::size_t drop, std::int64_t threshold, std::vector<Ranked>& ranked,
                    std::vector<std::size_t>& holes) const;
  // task(begin, end, thread) over heads [0, total), on one thread below kObserveThreadWork of work,
  // else split across threads (exceptions rethrown on the caller's).
  static void split_heads(std::size_t total, double work, const std::function<void(std::size_t, std::size_t, std::size_t)>& task);
  std::size_t recent_count(std::size_t limit) const;
  std::int64_t newest_ = std::numeric_limits<std::int64_t>::min();  // the highest position absorbed
  bool in_order_call_ = false;  // this call's positions rise past every position held
  Scoring scoring() const { return fallback_ ? Scoring::key_proxy : policy_.scoring; }
  // Working memory of one thread of observe(), per head in turn (each thread its own).
  struct ObserveScratch {
    std::vector<float> contribution, exposure, pooled;  // [rows] this observation's attention, exposure, pooled
    std::vector<std::size_t> order;                      // [rows] slots in position order
    std::vector<std::int64_t> board_positions;           // [rows] exchange: ascending positions
    std::vector<float> board_values, own_values, board_seen;
    std::size_t window_queries = 0;                      // queries the last observation_contribution counted
  };
  // One observation's contribution of head `head` into sc.pooled (window, decay weights, pooling);
  // returns the decay factor the stored scores take first.
  float observation_contribution(const AttentionObservation& obs, std::size_t head, ObserveScratch& sc) const;
  // After head `head` took this observation: adds the other layers' importance of its rows (times
  // cross_layer, weighed like the observation's own attention) and posts its own.
  void exchange_importance(std::size_t head, ObserveScratch& sc);
  // sc.order = the slots of head `head` in position order.
  void order_by_position(std::size_t head, ObserveScratch& sc) const;

  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  EvictionPolicy policy_;
  std::size_t batch_ = 0, heads_ = 0, dim_ = 0;
  std::size_t capacity_ = 0;  // allocated rows per head
  std::size_t rows_ = 0;      // valid rows per head (equal for every head)
  std::unique_ptr<RowStorage> storage_;   // the rows, in slot order (fp16 slots: [batch * heads, capacity, dim])
  UninitBuffer<float> scores_;            // [batch * heads, capacity] cumulative attention mass
  UninitBuffer<float> exposure_;          // [batch * heads, capacity] queries that could see the row (normalized scoring only)
  UninitBuffer<float> weight_;            // [batch * heads, capacity] policy_.row_weight of the row (registered scores only)
  UninitBuffer<std::int64_t> positions_;  // [batch * heads, capacity] absolute positions
  std::deque<std::int64_t> recent_;      // the last recent_window absorbed positions (all heads)
  std::vector<std::int64_t> thresholds_;  // [S] recent-window threshold after each incoming token
  // drop_lowest scratch, per head: its evictable rows ranked, the slots that leave.
  struct Ranked {
    float score;
    std::int64_t position;
    std::size_t slot;
  };
  std::vector<std::vector<Ranked>> ranked_;
  std::vector<std::vector<std::size_t>> holes_;
  std::size_t head_rows_ = 0;            // rows per head after absorb_heads
  std::size_t reserve_hint_ = 0;         // reserve(): rows the caller expects at most
  std::size_t last_limit_ = kNone;       // the limit of the last absorb / observe
  bool awaiting_observation_ = false;    // attention scoring: absorbed rows not yet observed
  bool fallback_ = false;                // see fell_back()
  std::size_t hold_above_ = EvictionPolicy::kUnbounded;  // see hold_compression_above()
  std::shared_ptr<const PriorScores> prior_;     // null: the window's attention alone (the usual case)
  std::shared_ptr<CrossLayerImportance> board_;  // null: this layer scores alone
  std::size_t board_layer_ = 0;          // this core's ordinal on the board
  std::size_t prefill_calls_ = 0;        // multi-query observations so far (the board's call index)
  std::vector<ObserveScratch> observe_scratch_;  // one per thread of observe()
};

}  // namespace kvslim
