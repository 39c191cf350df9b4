// What the device eviction cache (device_eviction_cache.h) needs of the rows it keeps in GPU memory,
// beyond the RowStorage the eviction core drives: where a step's rows land, how its attention
// reads them, and how tests and materialize() read them back. Two kinds:
// - DeviceSlots (fp16 / bf16 slots; device_eviction_cache.h): the core's slot order is the store's
//   row order, a decode step's eviction can run in one kernel (and replay as a graph);
// - DevicePackedRows (kivi codes; device_packed_rows.h): the CPU's PackedRows on the device, one
//   quantization group per block, rows erased inside their group, decided on the host.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "cuda/append.h"
#include "cache/eviction_core.h"
#include "cuda/attend.h"
#include "cuda/device_prompt_scoring.h"
#include "storage/row_storage.h"

namespace kvslim::cuda {

class DeviceRowStore : public RowStorage {
 public:
  // The stream the next operations are ordered on (the caller's, set before each core call).
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  // While a decode step is captured: what would allocate or copy from the host is refused.
  void set_capturing(bool on) { capturing_ = on; }
  // What prepare() launches for the next absorb (the append kernel; cleared once run or dropped).
  void set_arrival(std::function<void()> launch) { arrival_ = std::move(launch); }
  void prepare(std::size_t incoming) override {
    if (!arrival_) return;
    const auto launch = std::move(arrival_);
    arrival_ = nullptr;
    launch();
  }

  // The step's input rows [B*H, S, D] land after the `rows` kept ones of every head (launched by
  // prepare(), once the core has made room).
  virtual void place(const AppendInput& in, std::size_t rows, cudaStream_t stream) = 0;
  // Enqueues what the core's last decisions recorded (moves, erasures) before anything reads rows.
  virtual void flush() = 0;
  // The attention kernels over the `rows` rows of every head; returns the parts written (count_only:
  // just counts them). attention_scoring: rows leave after the attend (fp16 slots may then keep
  // rows in a cheaper order; see DenseRows::unordered).
  virtual int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, std::size_t rows,
                              bool attention_scoring, int sm_count, cudaStream_t stream) const = 0;
  // Rows the kernels' logits span per head (>= rows when the store keeps gaps), and the reorder of
  // probabilities over them ([B*Hkv, S, attention_rows]) into the core's slot order [B*Hkv, S, rows].
  virtual long long attention_rows(std::size_t rows) const { return static_cast<long long>(rows); }
  // The most rows the kernels may span before the store next grows, and the attention parts a
  // one-token step would write then (0: as many as the last eager step's; graph workspaces).
  virtual long long attention_rows_capacity(std::size_t rows) const { return attention_rows(rows); }
  virtual int parts_at_capacity(const QueryArgs&, int /*sm_count*/) const { return 0; }
  virtual void order_probs(const float* spanned, float* probs, int S, std::size_t rows, cudaStream_t stream) const {
    (void)spanned, (void)probs, (void)S, (void)rows, (void)stream;
  }
  // fp16 keys / values [rows, D] and positions [rows] of head bh, in slot order (host; waits).
  virtual void download_head(std::size_t bh, std::size_t rows, std::uint16_t* keys, std::uint16_t* values) const = 0;
  virtual void head_positions(std::size_t bh, std::size_t rows, std::int64_t* out) const = 0;
  // Host memory of the store's own bookkeeping.
  virtual std::size_t host_bytes() const = 0;
  // The core's per-row metadata and the device's mirrors of it (score, exposure; positions), for a
  // decision on the host after decode steps decided on the device: positions of every row, scores
  // and exposure of the first `seen` (the later ones were appended since: the core's fresh zeros).
  // Waits for the stream.
  virtual void download_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t seen) const = 0;
  // After a decision on the host: the core's scores and exposure into the mirrors; n_sink: the
  // leading rows a device step never evicts.
  virtual void upload_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t n_sink) = 0;
  // The eviction core's drop_lowest(drop) decided and applied here, from the mirrors, without the
  // host reading the rows' metadata (select_lowest.h): each head's `drop` lowest candidates (slot
  // >= n_sink, position below `threshold`; rows at or past fresh_from scored 0, as the core's fresh
  // rows) by (effective score, position) leave, the store's rows moving as the core's storage calls
  // would move them; the core's own metadata is then the store's to refresh (download_metadata).
  // false: nothing was done, the host decides (a store or a state this does not take).
  virtual bool drop_lowest_on_device(std::size_t rows, std::size_t drop, std::int64_t threshold, std::size_t n_sink,
                                     std::size_t fresh_from) {
    (void)rows, (void)drop, (void)threshold, (void)n_sink, (void)fresh_from;
    return false;
  }
  // A first prompt's rows for the device's prompt scoring (device_prompt_scoring.h): each head's
  // `rows` rows as one array in slot order, which is position order; sink_position: the position
  // of the n_sink-th row, at or below which no row leaves (INT64_MIN: no sinks), for the trim that
  // follows. false: the store does not hold them so (the host decides).
  virtual bool prompt_rows(std::size_t rows, std::int64_t sink_position, PromptRows& out) {
    (void)rows, (void)sink_position, (void)out;
    return false;
  }

 protected:
  cudaStream_t stream_ = nullptr;
  bool capturing_ = false;
  std::function<void()> arrival_;
};

}  // namespace kvslim::cuda
