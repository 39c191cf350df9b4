// Eviction on the device: h2o and pyramidkv whose rows live in GPU memory and leave it for real.
//
// The policy is the CPU's own eviction core (cache/eviction_core.h), unchanged: per head it keeps
// each row's position, score and exposure on the host and decides which rows stay, so every
// profile, the observation window, pooling, normalised scoring and the cross-layer exchange are
// the CPU cache's by construction. The rows are a RowStorage in GPU memory (DeviceSlots): fp16 /
// bf16 slots [B*H, stride, D] and every head's own positions [B*H, stride]. The append kernel
// places a step's rows at the end of every head; the core's moves (an evicted row's slot refilled
// by the head's last row) are recorded and applied by one kernel per step; the core's relayout
// after a prefill's eviction reallocates the store to the budget, so the allocator's figure falls.
//
// What crosses to the host: each observation's probabilities (attend's probs, [B, Hkv, Q, rows]),
// copied on the caller's stream, which waits for them -- the price of running the CPU's policy
// as it is (docs/cuda.md measures it). The attention itself reads the slots where they lie.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cache/eviction_cache.h"
#include "cache/eviction_core.h"
#include "cache/squeeze_schedule.h"
#include "cuda/device_cache.h"
#include "cuda/device_packed_rows.h"
#include "cuda/device_prompt_scoring.h"
#include "cuda/device_row_store.h"

namespace kvslim::cuda {

// The eviction core's rows in GPU memory: slots [heads_total, stride, D] (fp16 or bf16, the first
// append's element type), positions [heads_total, stride]; stride = the core's capacity rounded up
// to 16 rows (the dense kernel reads whole units of 16).
class DeviceSlots final : public DeviceRowStore {
 public:
  // with_exposure: the policy normalises by exposure (attention_normalized), mirrored too.
  explicit DeviceSlots(bool with_exposure) : with_exposure_(with_exposure) {}
  std::string_view kind() const override { return "fp16"; }
  bool slot_writes() const override { return true; }
  void begin(std::size_t heads_total, std::size_t dim) override;
  // Applies the recorded moves, then reallocates to `capacity` rows per head keeping the first
  // `keep` (waits for the copy before the old store goes).
  void relayout(std::size_t capacity, std::size_t keep) override;
  // Rows arrive through the append kernel (DeviceEvictionCache::absorb); the core never writes one.
  void write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) override;
  // Recorded; applied by flush() (or before a relayout), all of a step's moves in one kernel.
  void move(std::size_t head, std::size_t from, std::size_t to) override;
  void erase(std::size_t head, std::span<const std::size_t> slots) override;
  void key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const override;
  void feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const override;
  CacheView view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                 std::size_t pos_stride) const override;
  std::size_t resident_bytes() const override {
    return k_.bytes() + v_.bytes() + pos_.bytes() + scores_.bytes() + exposure_.bytes();
  }
  void reset() override;

  void set_type(DenseType type) { type_ = type; }
  DenseType type() const { return type_; }
  // The step's rows after the kept ones (the core has made room; prepare() runs this before the
  // core moves any of them).
  void place(const AppendInput& in, std::size_t rows, cudaStream_t stream) override;
  // Enqueues the moves recorded since the last flush: one move per head, the same in every head
  // (streaming's decode step), as kernel arguments; any other list copied from the host (refused
  // while a replayed step is armed). (While a decode step is captured a relayout -- a copy on the
  // stream, an allocation -- would enter the graph: refused.)
  void flush() override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, std::size_t rows,
                      bool attention_scoring, int sm_count, cudaStream_t stream) const override;
  void download_head(std::size_t bh, std::size_t rows, std::uint16_t* keys, std::uint16_t* values) const override;
  void head_positions(std::size_t bh, std::size_t rows, std::int64_t* out) const override;
  void download_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t seen) const override;
  void upload_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t n_sink) override;
  // The victims chosen on the device, then the core's hole filling (each hole below the kept count,
  // ascending, takes the last kept row above it) applied to the rows and their mirrors.
  bool drop_lowest_on_device(std::size_t rows, std::size_t drop, std::int64_t threshold, std::size_t n_sink,
                             std::size_t fresh_from) override;
  // The slots and their mirrors as they are (the sinks are the leading slots).
  bool prompt_rows(std::size_t rows, std::int64_t, PromptRows& out) override {
    if (rows > stride_ || capturing_) return false;
    flush();
    out = PromptRows{scores(), exposure(), positions(), static_cast<long long>(stride_)};
    return true;
  }
  std::uint16_t* keys() const { return k_.as<std::uint16_t>(); }
  std::uint16_t* values() const { return v_.as<std::uint16_t>(); }
  std::int64_t* positions() const { return pos_.as<std::int64_t>(); }
  // The core's per-row metadata mirrored for the decode-step kernel: scores and (normalised
  // scoring) exposure, [heads_total, stride] (exposure null without it).
  float* scores() const { return scores_.as<float>(); }
  float* exposure() const { return with_exposure_ ? exposure_.as<float>() : nullptr; }
  std::size_t stride() const { return stride_; }
  // Host memory of the move bookkeeping (the epoch marks, the recorded moves).
  std::size_t host_bytes() const override {
    return (read_in_.capacity() + written_in_.capacity()) * sizeof(std::uint32_t) + moves_.capacity() * sizeof(int);
  }

 private:
  bool with_exposure_;
  DeviceBuffer k_, v_, pos_, scores_, exposure_;
  std::size_t heads_total_ = 0, dim_ = 0, stride_ = 0;
  DenseType type_ = DenseType::f16;
  // Moves since the last flush: (head, from, to) triplets. One kernel applies them all at once,
  // which is the core's sequential order only while no move reads a slot another one writes:
  // move() flushes first when a new move would. read_in_ / written_in_ [heads_total * stride]: the
  // flush epoch in which a slot was last read / written (a prompt's eviction moves millions of
  // rows: an array, not a hash set).
  std::vector<int> moves_;
  bool uniform_moves() const;
  void next_epoch();
  std::vector<std::uint32_t> read_in_, written_in_;
  std::uint32_t epoch_ = 1;
  DeviceBuffer moves_dev_;
};

// h2o / pyramidkv on the device: the eviction core over DeviceSlots, scored by the attention its
// caller observes (attend with probs, then observe_attention with them, as on the CPU). streaming
// (scoring none) too: the core admits each appended row on the host (it needs only positions) and
// the rows move on the device (a decode step's one move per head as kernel arguments, so its steps
// replay as a graph too); over kivi codes a decode step at the budget is admitted by the device
// (evict_oldest_on_device: the decode observation by position erases the oldest evictable row),
// so it replays as a graph as well. squeeze: the same cache with the layer's part in the shared schedule
// (SqueezeSchedule, the host cache's own): its key signal is measured on the device (one kernel
// over the first call's keys), its attention signals on the prompt window's probabilities the
// host decision copies over anyway, and an adopted budget trims the device store.
//
// Two places decide, with the same arithmetic. A multi-query observation (a prompt's window, a
// later question) runs the core on the host: the probs are copied over, the core scores, pools,
// exchanges across layers and evicts, its moves are applied on the device and its metadata
// written to the device mirror. A decode step's observation (one query, at most one row over the
// limit) runs on the device in one kernel (observe() for one query, then drop_lowest(1), bit for
// bit), so a step neither copies nor waits; the core is told the outcome (observed_by_owner) and
// its metadata is read back from the mirror before it next decides on the host.
class DeviceEvictionCache final : public DeviceCache, public SharesImportance {
 public:
  // squeeze: the layer's schedule (null for the fixed-budget methods). store: where the rows live
  // (null: fp16 / bf16 slots; DevicePackedRows: kivi codes, every decision on the host).
  DeviceEvictionCache(std::string method, EvictionPolicy policy, std::size_t budget, int device,
                      std::unique_ptr<SqueezeSchedule> squeeze = nullptr, std::unique_ptr<DeviceRowStore> store = nullptr);
  ~DeviceEvictionCache() override;

  std::size_t rows() const override { return core_.rows(); }
  void reserve(std::size_t tokens) override { core_.reserve(tokens); }
  ObservationNeeds needs() const override;
  // probs in device memory (this cache's attend) or host memory; [B, Hkv, Q, rows()].
  void observe_attention(const AttentionObservation& obs) override;
  void share_importance(std::shared_ptr<CrossLayerImportance> board, std::size_t layer) override {
    board_ = board;
    board_layer_ = layer;
    core_.share_importance(std::move(board), layer);
  }
  const EvictionCore& core() const { return core_; }
  std::size_t budget() const { return budget_; }
  // What eviction cuts to now: the budget, or above it while squeeze's deferred schedule is open.
  std::size_t limit() const { return squeeze_ ? squeeze_->eviction_limit(budget_) : budget_; }
  const SqueezeSchedule* squeeze() const { return squeeze_.get(); }
  // A decode step replays once the cache holds its budget: append one row, attend with
  // probabilities over budget + 1 rows, the decode kernel's observation and eviction. Over kivi
  // codes the compression an eager step's observation would run (a full window, a re-pack) runs
  // between two replays, on the stream ahead of the next (graph_between_steps).
  bool graph_replayable() const override { return true; }
  const DeviceRowStore& store() const { return *store_; }

 private:
  long long attention_rows() const override { return store_->attention_rows(core_.rows()); }
  void order_probs(const float* spanned, float* probs, int S, cudaStream_t stream) const override {
    store_->order_probs(spanned, probs, S, core_.rows(), stream);
  }
  bool orders_probs() const override { return slots_ == nullptr; }
  int parts_at_capacity(const QueryArgs& q) const override { return store_->parts_at_capacity(q, sm_count_); }
  long long attention_rows_capacity() const override { return store_->attention_rows_capacity(core_.rows()); }
  void graph_between_steps(cudaStream_t stream) override;
  void graph_reserve_step() override;
  bool graph_observes() const override { return scores_by_attention(core_.policy().scoring); }
  void graph_check_capturable() const override;
  bool graph_next_step_replays() const override;
  void graph_observe(const AttentionObservation& obs) override;
  void absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const override;
  void download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const override;
  std::size_t device_bytes() const override { return store_->resident_bytes(); }
  std::size_t host_bytes() const override;
  void head_positions(std::size_t bh, std::int64_t* out) const override;
  void clear() override;
  void add_figures(CacheStats& st) const override;

  // streaming over kivi codes at its budget, one decode row: the core lets the device admit it
  // (EvictionCore::owner_may_admit).
  bool streams_on_device(const AppendInput& in, const std::vector<std::int64_t>& positions) const;
  // That admission: the row placed after the kept ones, then the decode observation by position
  // (no probabilities: the victim is the oldest row after the sinks below the core's threshold,
  // the row absorb() would erase), then the compression the core's settle() would run.
  void evict_oldest_on_device(std::int64_t position, cudaStream_t stream);
  // A decode step over kivi codes decided on the device (observe_decode over step.rows rows, one
  // dropped past step.limit), the core told, then the compression an eager step ends with.
  void decode_codes_step(const DevicePackedRows::DecodeStep& step, cudaStream_t stream);
  // Runs a one-query device observation in the decode kernel; false: the host must decide.
  bool observe_on_device(const AttentionObservation& obs);
  // The same over kivi codes (DevicePackedRows::observe_decode), then the host's compression.
  bool observe_codes_on_device(const AttentionObservation& obs, const DeferredProbs* deferred);
  // A first prompt's observation scored and trimmed on the device (device_prompt_scoring.h, then
  // the store's drop_lowest_on_device); false: the host decides (nothing was changed).
  bool prompt_on_device(const AttentionObservation& obs, const std::string& who);
  // The model's device board beside the host one (null: no exchange on the device).
  std::shared_ptr<DeviceImportanceBoard> device_board() const;
  // The decode observation's per-part scratch for `parts` parts a head.
  void reserve_observe_parts(std::size_t parts, cudaStream_t stream);
  // The mirror's metadata (rows' positions; scores and exposure of the rows observed so far) into
  // the core, when the decode kernel changed it since.
  void pull_metadata();
  // The core's metadata of every row into the mirror (after a host decision).
  void push_metadata(cudaStream_t stream);
  // The core's compression held while squeeze's deferred schedule may still cut rows.
  void hold_while_uncertain();
  // Whether that hold is on now (the rows above the budget may still be cut).
  bool compression_held() const { return limit() > budget_ && core_.rows() > budget_; }
  // squeeze: a budget the schedule resolved, adopted (the store trimmed to it on the device).
  void adopt(std::optional<std::size_t> budget, cudaStream_t stream);
  // squeeze's key signal of a call's keys (the append's input [BH, S, D]): the mean over heads (or
  // head 0, squeeze_concentration_heads = first) of the mean off-diagonal key cosine.
  HeadTerms key_dispersion(const AppendInput& in, cudaStream_t stream) const;

  DeviceRowStore* store_;  // owned by core_
  DeviceSlots* slots_;     // store_ when it is the fp16 slots (decode steps decided on the device), else null
  EvictionCore core_;
  std::size_t budget_;
  std::unique_ptr<SqueezeSchedule> squeeze_;
  std::size_t fresh_from_ = 0;  // rows at or past this were appended after the last observation
  bool host_stale_ = false;     // the decode kernel changed the mirror since the core last decided
  // streaming over codes: the mirror holds the host's metadata since its last decision (pushed by
  // the first device step after it); a capture needs it, as the push waits for the stream.
  bool streaming_mirror_current_ = false;
  float* probs_host_ = nullptr;  // pinned [B * Hkv * Q * rows] copy of a device observation
  std::size_t probs_host_floats_ = 0;
  // The decode observation split over several CTAs per head: each part's lowest candidate
  // [heads_total, parts] and each head's count of parts done [heads_total] (zero between steps).
  DeviceBuffer observe_best_, observe_arrivals_;
  std::size_t observe_parts_capacity_ = 0;
  std::size_t decode_steps_on_device_ = 0;  // decode steps whose eviction a device kernel decided (a figure)
  // Host wall time of the decisions the host core still makes (a prompt's window, squeeze's
  // adopted budget), by phase, summed over calls (figures host_decision_*_ms): what moving them
  // to the device would save. wait: the stream's queued work (the model's, not the decision's).
  struct HostDecisionTimes {
    double wait_ms = 0, probs_ms = 0, pull_ms = 0, core_ms = 0, flush_push_ms = 0;
    std::size_t calls = 0;
  };
  HostDecisionTimes host_times_;
  std::size_t trims_on_device_ = 0;  // adopted budgets whose drop the store decided (a figure)
  // The last append, when it was a prompt into an empty cache with positions p0, p0 + 1, ...: the
  // only observation prompt_on_device takes.
  bool prompt_from_empty_ = false;
  std::int64_t prompt_p0_ = 0;
  std::shared_ptr<CrossLayerImportance> board_;
  std::size_t board_layer_ = 0;
  std::size_t prompts_on_device_ = 0;  // prompts scored and trimmed on the device (a figure)
  double device_prompt_ms_ = 0;        // their wall time (waits for the stream's queued work first)
  double device_trim_ms_ = 0;        // their wall time, select and moves included (not a host decision)
};

}  // namespace kvslim::cuda
