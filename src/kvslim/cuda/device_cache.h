// The device caches (kvslim/cuda.h): what they share (intake checks, the deferred input-error
// flag, the attention workspace and the split/combine orchestration), the dense store of `full`,
// and kivi's packed-code store with its fp16 staging window.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/append.h"
#include "cuda/attend.h"
#include "cuda/device_buffer.h"
#include "cuda/step_graph.h"
#include "kvslim/cache.h"
#include "kvslim/config.h"

namespace kvslim::cuda {

class DeviceCache : public KVCache {
 public:
  DeviceCache(std::string method, int device);
  ~DeviceCache() override;

  void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions = {}) final;
  void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
              float* probs = nullptr, const ParallelFor* parallel = nullptr) const final;
  // KVCache's attend + observe_attention, except that a one-query step of a cache that observes
  // every step (an eviction cache's decode step, eager or replayed) leaves its probabilities to
  // the observation, which scores each row from the attention's logits and writes none of them.
  void attend_and_observe(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                          float* probs, std::size_t kv_heads, const ParallelFor* parallel = nullptr) final;
  std::size_t rows() const override { return positions_.size(); }
  CacheView materialize() const final;
  CacheStats stats() const final;
  void reset() final;
  std::string_view method() const final { return method_; }

  int device() const { return device_; }
  // Waits for this cache's last work and raises a pending input error (tests, tools).
  void synchronize() const;
  // The stream of the last call (where the cache's state is ordered).
  cudaStream_t stream() const { return stream_; }

  // Decode steps replayed as a CUDA graph (kvslim/cuda.h StepGraph; step_graph.h). Only storages
  // whose step has no host decision the graph could not replay say yes.
  virtual bool graph_replayable() const { return false; }
  // Whether attend can report probabilities over the rows() in their view order.
  virtual bool gives_probabilities() const { return true; }
  // The next append + attend are captured (their kernels recorded as nodes); the attention
  // workspace is sized first for the capacity reserved, since a capture cannot allocate.
  void graph_begin(int query_heads, int query_tokens);
  // Capture over: checks that the step appended and attended once each.
  void graph_captured();
  LaunchSlots& graph_slots();
  // Before a replay: the next step's append + attend run their host logic, each launch updating its
  // node in `exec` instead of reaching the stream (storage growth, a plain copy, still runs on
  // `stream`, ahead of the graph); the host state advances as after an eager step.
  void graph_arm(cudaGraphExec_t exec, cudaStream_t stream);
  // After a replay's launch: the input-error flag is ordered after it.
  void graph_launched(cudaStream_t stream);
  // Before the next step (StepGraph::next_step_replays): after replays (`replayed`), the host work
  // the last one left, on `stream`; then whether the next step can be replayed (or captured).
  bool graph_prepare_next(cudaStream_t stream, bool replayed) {
    if (replayed) graph_between_steps(stream);
    return graph_next_step_replays();
  }
  // Back to eager steps only.
  void graph_end();

 protected:
  // The method's part of append, after every check: enqueue on `stream`.
  virtual void absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) = 0;
  // Launches the attention kernels of every segment into the workspace's parts, in row order;
  // returns the number of parts written. `splits_only` = true: just count them.
  virtual int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const = 0;
  // fp16 rows of head bh into keys/values [rows, D] (host), after synchronize().
  virtual void download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const = 0;
  virtual std::size_t device_bytes() const = 0;
  // Host memory the cache keeps (the position mirror; an eviction cache's per-row metadata).
  virtual std::size_t host_bytes() const { return positions_.capacity() * sizeof(std::int64_t); }
  // Positions of head bh's rows() rows, in row order (every head the same unless rows are evicted).
  virtual void head_positions(std::size_t bh, std::int64_t* out) const;
  virtual void clear() = 0;
  virtual void add_figures(CacheStats&) const {}
  // Raises the deferred input error of an earlier append, if its kernel found one (no wait).
  void raise_pending_error() const { check_pending_error(false); }
  // A replayed (or captured) decode step of a cache that observes its attention leaves its
  // probabilities to the observation kernel, which computes them from the attention's logits and
  // (max, sum) as attend's probs kernel would and writes them where attend was asked to: one launch
  // fewer per layer and step. What that kernel needs, taken once (null probs: nothing deferred).
  struct DeferredProbs {
    float* probs = nullptr;          // [B * Hkv, rows_total] (one query token); null: nothing deferred
    // false: nobody reads them (attend_and_observe): the observation computes each row's weight
    // and uses it, and writes nothing to probs (unless it runs on the host: fill_probs).
    bool written = true;
    QueryArgs query;                 // the step: logits [B * Hkv, G, rows_total], G, rows_total
    const float* final_ml = nullptr;  // [B * Hkv, G, 2]
  };
  DeferredProbs take_deferred_probs() const;
  // Runs attend's own probs kernel for them (an observation that cannot compute them itself),
  // and the reorder into slot order where the store spans other rows.
  void fill_probs(const DeferredProbs& d, cudaStream_t stream) const;
  // Rows the attention kernels span per head (their logits' row count): rows() unless the storage
  // keeps gaps (padding inside its groups); then order_probs puts probabilities over them
  // ([B*Hkv, S, attention_rows()]) into row order ([B*Hkv, S, rows()]).
  virtual long long attention_rows() const { return static_cast<long long>(rows()); }
  virtual void order_probs(const float* spanned, float* probs, int S, cudaStream_t stream) const {
    (void)spanned, (void)probs, (void)S, (void)stream;
  }
  // The last attend's probabilities when it computed them over attention_rows() first: where the
  // caller got them (probs) and the spanned ones they were reordered from (valid until the next attend).
  struct SpannedProbs {
    const float* probs = nullptr;
    const float* spanned = nullptr;
    long long rows_total = 0;
  };
  SpannedProbs last_spanned_probs() const { return spanned_probs_; }
  // Whether attend always reorders its probabilities (order_probs), even when attention_rows()
  // happens to equal rows(): a store whose rows lie out of slot order (eviction over codes). Its
  // probabilities have rows() columns whatever the kernels span; a replayed step's observation
  // writes them in slot order itself (DeferredProbs).
  virtual bool orders_probs() const { return false; }
  // The most rows the attention may span before the storage next grows (graph workspaces).
  virtual long long attention_rows_capacity() const { return attention_rows(); }
  // Attention parts the segments would use at the reserved capacity (graph_begin's workspace).
  virtual int parts_at_capacity(const QueryArgs&) const { return 0; }
  // A cache whose step also observes its attention (eviction): graph_begin refuses a cache whose
  // replayed steps would not keep one row count (the probabilities' shape) and says why; a
  // replayed step re-arms its observation after its attention (graph_observe).
  virtual bool graph_observes() const { return false; }
  virtual void graph_check_capturable() const {}
  virtual void graph_observe(const AttentionObservation&) {}
  // Host work between two replays, before the next step is armed: it reaches the stream ahead of
  // the next replay, not the graph (what an eager step would have done after its observation).
  virtual void graph_between_steps(cudaStream_t) {}
  // Room for the captured step, made before the capture (which may not allocate).
  virtual void graph_reserve_step() {}
  // Whether the next step's host logic fits a replay (false: it decides on the host before its
  // attention; the caller takes that step eagerly).
  virtual bool graph_next_step_replays() const { return true; }

  // A captured decode step: the calls' device addresses (fixed while the graph is replayed) and
  // the nodes their kernels made.
  struct StepRecord {
    bool capturing = false, appended = false, attended = false, observed = false;
    AppendInput append;      // positions: first_position + i, set per step
    QueryBlock queries;      // data, shape, scale
    float* out = nullptr;
    float* probs = nullptr;  // [B, Hkv, S, probs_rows] when the step observes its attention
    bool probs_unread = false;  // captured by attend_and_observe: probs are never written (DeferredProbs)
    long long probs_rows = 0;  // rows_total, or rows() when the cache orders its probabilities
    AttentionObservation observation;  // query_positions set per step
    LaunchSlots slots;
  };
  std::unique_ptr<StepRecord> step_;
  // Whether a step is being captured (the storage cannot grow: KVCache::reserve first).
  bool capturing() const;
  // Whether this step is a replayed graph's (captured now, or re-armed): its kernels are the graph's
  // nodes, so a plain copy on the stream would run before them, not after.
  bool in_graph_step() const { return capturing() || arming_; }

  std::size_t batch_ = 0, heads_ = 0, dim_ = 0;
  int sm_count_ = 0;
  // false: the base does not mirror every appended position (a cache whose rows are evicted keeps
  // its own per-head positions).
  bool mirror_positions_ = true;

 private:
  void check_pending_error(bool wait) const;
  // append / attend after their checks (shared by eager calls and a replayed step's re-arming).
  void absorb_step(const AppendInput& in, const std::vector<std::int64_t>& resolved, cudaStream_t stream);
  QueryArgs query_args(const QueryBlock& queries, std::span<const std::int64_t> query_positions) const;
  // Who produces the probabilities attend was asked for: attend's own kernels, or the step's
  // observation from the attention's logits (DeferredProbs), writing them or (unread: the caller
  // is attend_and_observe) not. The observation takes them for a one-token step of a cache that
  // observes every step, when the step is captured or re-armed (its caller reads probs only
  // through the observation) or when they are unread.
  enum class ProbsBy { attend, observation, observation_unwritten };
  ProbsBy probs_by(const float* probs, int query_tokens, bool graph_step, bool unread) const {
    if (probs == nullptr || !graph_observes() || query_tokens != 1 || !(graph_step || unread)) return ProbsBy::attend;
    return unread ? ProbsBy::observation_unwritten : ProbsBy::observation;
  }
  // The replayed step's logits workspace (and its (max, sum)) at attention_rows_capacity() (a
  // capture cannot allocate it; a re-armed step would re-allocate it as the rows grow).
  void reserve_step_workspace(int query_tokens, int query_groups);
  void attend_checked(const QueryArgs& q, float* out, float* probs, cudaStream_t stream,
                      ProbsBy probs_by = ProbsBy::attend) const;


  std::string method_;
  int device_;
  std::uint64_t tokens_seen_ = 0;
  std::int64_t next_position_ = 0;
  std::vector<std::int64_t> positions_;  // host mirror, cache row order
  mutable cudaStream_t stream_ = nullptr;
  // Deferred input check: append kernels atomicMin the first bad row into bad_ and store a bad row
  // into mapped host memory (no copy per step); flag_event_ says when the step's kernels are done.
  DeviceBuffer bad_;
  int* bad_host_ = nullptr;         // mapped pinned host memory the append kernels write a bad row into
  int* bad_host_device_ = nullptr;  // its device address
  cudaEvent_t flag_event_ = nullptr;
  mutable bool poisoned_ = false;
  mutable std::string poison_message_;
  // Attention workspace (grown on demand).
  mutable DeviceBuffer parts_acc_, parts_ml_, final_ml_, logits_, qpos_;
  mutable DeviceBuffer merge_arrivals_;  // [tiles, B*Hkv] counters of the fused merge (Partials::arrivals)
  mutable DeviceBuffer probs_spanned_;  // [B*Hkv, S, attention_rows()] when that is not rows()
  mutable SpannedProbs spanned_probs_;
  mutable DeferredProbs deferred_probs_;
  bool probs_unread_ = false;  // inside attend_and_observe: attend's probs are read by its observation only
  bool arming_ = false;  // graph_arm runs the step's host logic
  // materialize() scratch.
  mutable std::vector<std::uint16_t> view_keys_, view_values_;
  mutable std::vector<std::int64_t> view_positions_;
};

// InputError "<method> cache (cuda): <what>".
[[noreturn]] void reject(std::string_view method, const std::string& what);

// Rows [0, rows) of each of BH heads from a [BH, src_stride, row_bytes] store into a [BH, dst_stride,
// row_bytes] one, enqueued on `stream`.
void copy_head_rows(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride, std::size_t rows,
                    std::size_t BH, std::size_t row_bytes, cudaStream_t stream);
// Head bh's first n rows of a dense [BH, stride, D] store as fp16 on the host (bf16 converted); waits.
void download_dense_head(const std::uint16_t* k, const std::uint16_t* v, DenseType type, std::size_t stride,
                         std::size_t D, std::size_t bh, std::size_t n, std::uint16_t* keys, std::uint16_t* values);
// Throws InputError when p is not device memory of `device` (named `name` in the message).
void check_device_pointer(std::string_view method, const void* p, int device, const char* name);

// full: every row as fp16 (bf16 when the blocks are bf16) slots, [B*H, capacity, D].
class DeviceDenseCache final : public DeviceCache {
 public:
  explicit DeviceDenseCache(int device) : DeviceCache("full", device) {}
  void reserve(std::size_t tokens) override;
  DenseType store_type() const { return type_; }
  bool graph_replayable() const override { return true; }

 private:
  int parts_at_capacity(const QueryArgs& q) const override;
  void absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const override;
  void download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const override;
  std::size_t device_bytes() const override { return k_.bytes() + v_.bytes() + pos_.bytes(); }
  void clear() override;
  void grow(std::size_t rows, cudaStream_t stream);

  DeviceBuffer k_, v_, pos_;
  std::size_t capacity_ = 0, n_ = 0, reserved_ = 0;
  DenseType type_ = DenseType::f16;
};

// kivi: groups of group_rows rows (a multiple of 32), keys and values quantized per channel, each at
// its own width (2, 4 or 8 bits), then a window of fp16 rows (the newest, < staging) compressed a
// whole number of groups at a time.
class DeviceKiviCache final : public DeviceCache {
 public:
  DeviceKiviCache(int device, int key_bits, int value_bits, int group_rows, int staging);

  // Host copies of the stored state, for tests: codes [B*H][units*32*row_bytes] (keys and values at
  // their own row bytes), params [B*H][groups*2*D] (fp16 scale row then zero row per group of
  // group_rows rows), window rows fp16 [B*H][staged*D].
  struct Snapshot {
    int units = 0, staged = 0, k_row_bytes = 0, v_row_bytes = 0, group_rows = 32;
    std::vector<std::vector<std::uint8_t>> k_codes, v_codes;
    std::vector<std::vector<std::uint16_t>> k_params, v_params, stage_k, stage_v;
  };
  Snapshot snapshot() const;
  void reserve(std::size_t tokens) override;
  bool graph_replayable() const override { return true; }

 private:
  int parts_at_capacity(const QueryArgs& q) const override;
  void absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const override;
  void download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const override;
  std::size_t device_bytes() const override;
  void clear() override;
  void add_figures(CacheStats& st) const override;
  void grow_codes(std::size_t units, cudaStream_t stream);
  PackedRows packed_rows(int units) const;  // the store as the codes kernel reads it
  int group_units() const { return group_rows_ / 32; }

  int key_bits_, value_bits_, group_rows_, staging_;
  int k_row_bytes_ = 0, v_row_bytes_ = 0;  // 0 until the first append fixes D
  DeviceBuffer k_codes_, v_codes_, k_params_, v_params_, pos_;
  DeviceBuffer stage_k_[2], stage_v_[2], stage_pos_[2];
  int cur_ = 0;                    // which window buffer is live
  std::size_t unit_capacity_ = 0;  // 32-row units the code store holds (whole groups)
  std::size_t reserved_tokens_ = 0;
  int units_ = 0, staged_ = 0;
};

}  // namespace kvslim::cuda
