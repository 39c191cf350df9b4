// The CPU's compressed row storage (storage/packed_rows.h, kinds kivi and zipcache) in GPU memory:
// an eviction policy over kivi or zipcache codes on the device. Same blocks, same rounding, same
// rules as the CPU:
// - per head, a list of blocks, each ONE quantization group of at most group_rows rows (keys and
//   values per channel at their own widths, fp16 scale and zero rows), then an fp16 window;
// - an evicted row leaves its group without re-quantizing anyone (the group's parameters stay
//   valid for the rows that stay); a group emptied leaves the list; a head whose groups fell under
//   a quarter of the rows they were made with is re-packed (decoded and quantized again in full
//   groups, its rows keeping their order);
// - a prompt's survivors are compressed whole (full groups and one short group); decode rows once
//   `staging` wait (whole groups, or all of them as one short group when staging < group_rows).
// So a device cache's codes, parameters and positions equal the CPU cache's bit for bit when the two
// evict the same rows (tests/cuda).
//
// zipcache (PackedLayout::sets 2): each block's rows are split between two region stores that share
// region indices -- the salient rows (the hi_fraction of the group with the largest key norms,
// chosen on the device as the CPU's saliency_mask chooses them) with keys at key_bits[0], the others
// at key_bits[1], each set in token order at the front of its region, each set's keys quantized over
// its own rows and both sets' values with the whole group's parameters (the CPU's ZipCompressed keys
// and one value group). The host keeps each block's salient bits (a slot's set and place in it).
// Layout (every head the same shape, so one launch of the codes kernel reads a layer):
// - regions [B*H, region_capacity, group_rows rows]: block i of a head lies in a region, its rows
//   at the front in slot order, the rest of the region padding (position INT64_MAX, masked by every
//   query). An erasure moves the later rows of that group down (the codes kernel takes a unit's last
//   row as its newest: no gap may sit before a live row). Regions follow the block list after
//   settle (a dropped block's region is closed up by a re-layout of the store).
// - the window [B*H, window_capacity, D] fp16 with every head's positions: a step's rows land at the
//   same row of every head; a row evicted from the window only has its position masked (the dense
//   kernel checks every row of an unordered window); the window is closed up after a compression.
// Who decides: a multi-query observation (a prompt's window, a later question), a trim, squeeze's
// adoption run the eviction core on the host (its metadata pulled from and pushed to the device
// mirrors around it); a decode step's observation runs on the device in one kernel
// (observe_decode: the core's observe() for one query, then drop_lowest(1), bit for bit), and the
// host learns its victims (one int a head) to keep its block lists, then compresses as the CPU does.
// The policy's per-row mirrors (score, exposure) travel with their rows through every kernel that
// moves rows. attend reports probabilities in slot order (order_probs).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_row_store.h"
#include "cache/eviction_core.h"

namespace kvslim::cuda {

namespace packed_jobs {
// One group's rows of one set to quantize: `m` source rows (list[list_at..]) into region `region`
// of `head`; the value parameters over `vm` rows (list[vlist_at..]: the whole group's, which a
// zipcache set shares with the other set; kivi's one set: the same rows).
struct CompressJob {
  int head, region, m, list_at, vm, vlist_at;
};
// One region rewritten: its rows 0..n_new taken from old offsets list[list_at..] in order, rows
// n_new..n_old padding (n_new 0: the region emptied).
struct CloseJob {
  int head, region, n_old, n_new, list_at;
};
struct RegionStore;  // the regions as the kernels see them (device_packed_rows.cu)
struct WindowRows;   // a window buffer as the kernels see it
}  // namespace packed_jobs

// How the rows are held: kivi (one set: every key at key_bits[0]) or zipcache (two sets: a group's
// salient rows -- the hi_fraction of its rows with the largest key norms, as the CPU's
// saliency_mask picks them -- with keys at key_bits[0], the others at key_bits[1]); values at
// value_bits in both, quantized over the whole group as the CPU's PackedRows quantizes them.
struct PackedLayout {
  int sets = 1;
  int key_bits[2] = {4, 4};
  int value_bits = 2;
  double hi_fraction = 0.0;  // zipcache only
  int group_rows = 128;
  int staging = 128;
  bool with_exposure = false;  // the policy normalises by exposure (attention_normalized), mirrored too
};

class DevicePackedRows final : public DeviceRowStore {
 public:
  ~DevicePackedRows() override;
  // kivi codes; with_exposure: the policy normalises by exposure (attention_normalized), mirrored too.
  DevicePackedRows(int key_bits, int value_bits, int group_rows, int staging, bool with_exposure);
  explicit DevicePackedRows(const PackedLayout& layout);

  std::string_view kind() const override { return layout_.sets == 2 ? "zipcache" : "kivi"; }
  bool slot_writes() const override { return false; }
  void begin(std::size_t heads_total, std::size_t dim) override;
  void relayout(std::size_t capacity, std::size_t keep) override;
  void prepare(std::size_t incoming) override;
  void write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) override;
  void move(std::size_t head, std::size_t from, std::size_t to) override;
  void erase(std::size_t head, std::span<const std::size_t> slots) override;
  void settle(std::size_t rows, const Saliency& saliency) override;
  void key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const override;
  void feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const override;
  CacheView view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                 std::size_t pos_stride) const override;
  std::size_t resident_bytes() const override;
  void reset() override;
  void add_figures(CacheStats& stats) const override;

  void place(const AppendInput& in, std::size_t rows, cudaStream_t stream) override;
  void flush() override;
  int launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, std::size_t rows,
                      bool attention_scoring, int sm_count, cudaStream_t stream) const override;
  long long attention_rows(std::size_t rows) const override;
  void order_probs(const float* spanned, float* probs, int S, std::size_t rows, cudaStream_t stream) const override;
  void download_head(std::size_t bh, std::size_t rows, std::uint16_t* keys, std::uint16_t* values) const override;
  void head_positions(std::size_t bh, std::size_t rows, std::int64_t* out) const override;
  std::size_t host_bytes() const override;
  void download_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t seen) const override;
  void upload_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t n_sink) override;
  // While every row waits in the window (squeeze's held prompt before its budget is adopted): the
  // victims chosen on the device are masked where they lie, and the heads' window lists learn them
  // (one byte a window row read back). Rows in groups: false (the host decides).
  bool drop_lowest_on_device(std::size_t rows, std::size_t drop, std::int64_t threshold, std::size_t n_sink,
                             std::size_t fresh_from) override;
  // While every row of every head waits unmasked in the window, in window order: the window's
  // mirrors; the sinks' position becomes the trim's (sink_pos, as upload_metadata sets it).
  bool prompt_rows(std::size_t rows, std::int64_t sink_position, PromptRows& out) override;

  // A decode step's observation and eviction on the device (see the file comment): probs over the
  // rows the last attend spanned ([H, probs_stride], attention_rows() of them), or in slot order
  // ([H, probs_stride] over `rows`) when `slot_order`. The host's lists learn its victims (one int a head) lazily: the step does not wait.
  // No probabilities and no logits: by position (streaming's admission): every row adds 0, so the
  // victim is the oldest row after the sinks below the threshold.
  struct DecodeStep {
    const float* probs = nullptr;
    long long probs_stride = 0;
    bool slot_order = false;
    // A deferred step's probabilities (non-null logits; probs unused), computed by the observation
    // from attend's logits [H, G, attention_rows()] and (max, sum) [H, G, 2] and written in slot
    // order to probs_out [H, out_stride] unless it is null (nobody reads them: no slot-order scan).
    float* probs_out = nullptr;
    const float* logits = nullptr;
    const float* final_ml = nullptr;
    int G = 1;
    long long out_stride = 0;
    std::size_t rows = 0, limit = 0;
    std::int64_t qpos = 0, threshold = 0;
    float decay = 1.f;
  };
  void observe_decode(const DecodeStep& step, void* part_best, unsigned* arrivals, std::size_t parts, cudaStream_t stream);
  // Whether settle() may change anything after the decode steps so far (a window at `staging`, a
  // head that may fall under a quarter, counted with the victims not yet read): when not, the step
  // needs no host work at all. A group emptied by a victim needs none either: its region is all
  // padding on the device, and the next settle that acts re-lays the store out.
  bool settle_would_act() const;
  // The same after one more decode step (a row into every window, a victim taken), counted so that
  // it never says false where that step's settle would act (streaming's steps that must run eagerly).
  bool settle_may_act_after_step() const;
  // Between two replayed decode steps (StepGraph), on the stream ahead of the next replay: what an
  // eager step's observation would have settled (compression, re-packs), room in the window for the
  // next row, and the victims read once the ring of unread steps is full. `settle` false: squeeze's
  // deferred schedule holds the compression. Every launch here reaches the stream, not the graph.
  void between_replays(std::size_t rows, bool settle, cudaStream_t stream);
  // Room for a decode step without allocating (a captured step may not): the window one row more,
  // the victims' ring (a full ring read first). No slot-order scratch: a captured step's
  // observation writes slot order itself.
  void reserve_next_step();
  // Rows the attention may span before the store next grows (its regions and window at capacity).
  long long attention_rows_capacity(std::size_t rows = 0) const override;
  int parts_at_capacity(const QueryArgs& q, int sm_count) const override;

  // The host's picture of one head, for tests: blocks (rows now, rows when made) and window rows.
  struct Block {
    int region = 0;  // where its rows lie (the same region of every set)
    int tokens = 0;  // rows it holds
    int made = 0;    // rows when it was compressed
    // zipcache: [tokens] in token order, 1 = the row's keys are in the hi set (set 0); a set's
    // region holds that set's rows in token order. kivi: empty (every row in set 0).
    std::vector<std::uint8_t> salient;
    int rows_in(int set) const;  // rows of this block in `set`
    // The set of the block's row t (token order): 0 (kivi's only set, or salient), 1 (the lo set).
    int set_of(int t) const { return salient.empty() || salient[static_cast<std::size_t>(t)] != 0 ? 0 : 1; }
  };
  struct Head {
    std::vector<Block> blocks;
    std::size_t packed = 0, made = 0, repacks = 0;
    std::vector<int> window;  // the window rows it holds, ascending (slot order)
  };
  const std::vector<Head>& heads() const {
    apply_victims();
    return heads_;
  }
  // Host copies of head bh's blocks as the CPU's PackedRows::Block holds them: codes [tokens, row
  // bytes], parameters [2, D] (scale row, zero row), for keys and values.
  // zipcache: the hi set's (salient rows) codes and key parameters, then the lo set's in lo_*, the
  // value parameters the same in both sets; `salient` as Block::salient.
  struct BlockCodes {
    std::vector<std::uint8_t> k_codes, v_codes;
    std::vector<std::uint16_t> k_params, v_params;
    std::vector<std::uint8_t> lo_k_codes, lo_v_codes;
    std::vector<std::uint16_t> lo_k_params;
    std::vector<std::uint8_t> salient;
  };
  std::vector<BlockCodes> block_codes(std::size_t bh) const;

 private:
  using CompressJob = packed_jobs::CompressJob;
  using CloseJob = packed_jobs::CloseJob;
  int regions_used() const;            // regions the attention spans (the highest used + 1, over heads)
  // The first `regions` regions of a set as the codes kernels read them.
  PackedRows packed_rows(int regions, int set = 0) const;
  void relayout_regions(int capacity); // every head's blocks into regions 0.. of a store that size
  void ensure_window(int needed);      // window capacity >= needed rows
  void resize_window(int capacity);    // the window re-allocated, its rows kept
  void close_window();                 // every head's window rows to the front
  void repack(std::size_t head);  // the head's groups decoded and quantized again in full groups
  void launch_closes();  // every set's recorded closes
  void upload_tokens();  // the host's rows per region and set into each set's tokens (after the lists changed)
  packed_jobs::RegionStore regions(int set = 0) const;
  // The salient bits of the groups a compression made, read back (zipcache: its select kernel decided
  // them on the device); blocks [first, ...) of each head get theirs in job order.
  void read_saliency(const std::vector<std::pair<int, int>>& job_blocks, const std::vector<int>& job_rows);
  packed_jobs::WindowRows window(int which) const;
  void reserve_window(int which, int capacity);  // window buffer `which` for `capacity` rows a head
  void release_window(int which);
  // slot_of_ [H, span]: each spanned row's slot, from the device's counts (no host list read).
  void launch_slot_order(cudaStream_t stream) const;

  PackedLayout layout_;
  int key_bits_, value_bits_, group_rows_, staging_;  // key_bits_: set 0's (kivi's only set)
  bool with_exposure_;
  int v_rb_ = 0;  // row bytes of values (every set)
  std::size_t heads_total_ = 0, dim_ = 0;
  // The host's lists lag a decode step's victims until apply_victims() reads them (every reader of
  // the lists calls it first): mutable, as that lag is not the store's state.
  mutable std::vector<Head> heads_;
  bool flush_ = false;  // a multi-row append came: its survivors are compressed whole

  // Regions of each set: codes [H, cap * G, rb], params fp16 [H, cap, 2, D], positions, score and
  // exposure mirrors [H, cap * G], rows per region [H, cap] (the device's count: a decode step
  // lowers it). Set s's keys at layout_.key_bits[s] (k_rb bytes a row).
  struct SetStore {
    DeviceBuffer k_codes, v_codes, k_params, v_params, pos, score, expo, tokens;
    int k_rb = 0;
  };
  SetStore set_[2];
  int region_capacity_ = 0;
  // Window: fp16 [H, window_capacity, D], positions and mirrors [H, window_capacity]; [cur_] is the
  // live one, the other allocated only while resize_window copies into it (close_window works in
  // place, through window_map_).
  DeviceBuffer wk_[2], wv_[2], wpos_[2], wscore_[2], wexpo_[2];
  int cur_ = 0, window_capacity_ = 0, window_rows_ = 0;  // window_rows_: rows written since it was last closed up
  int fresh_w_ = 0;  // the window row of the last append's first row (unobserved rows score from 0)
  // Decode steps: positions at or below which rows are sinks [H]. Each step's victims (one spanned
  // index a head) go to the next slot of a ring [kVictimRing, H] on the device; the host reads the
  // ring when it next needs its lists (or the ring is full), so neither an eager nor a replayed step
  // waits for its own victims.
  static constexpr int kVictimRing = 64;
  struct PendingStep {
    int slot;     // ring slot of its victims
    int regions;  // the regions that step spanned (a victim below sets * regions * G lies in a group)
  };
  DeviceBuffer sink_pos_, victims_;
  // sink_pos_ names each head's last sink (the last upload held at least n_sink rows); otherwise it
  // protects no row, and only the core can tell the sinks.
  bool sinks_known_ = false;
  mutable int* victims_host_ = nullptr;  // pinned [kVictimRing, H] (allocated by the first read)
  mutable std::vector<PendingStep> pending_;
  int ring_next_ = 0;
  void apply_victims() const;
  // Whether settle() may act with `more_rows` more rows in every window and `taken` victims taken
  // since the lists were last read (settle_would_act, settle_may_act_after_step).
  bool settle_acts(int more_rows, std::size_t taken) const;
  void apply_step_victims(const int* victims, int regions) const;  // one step's [H], in step order
  // Recorded erasures, enqueued by flush(): window rows masked [flat index], groups closed up.
  std::vector<long long> masked_;
  std::vector<CloseJob> closes_[2];  // per set
  std::vector<int> close_list_[2];
  // Device copies of the job lists (reused; a list's copy is ordered before its kernel).
  DeviceBuffer list_dev_, jobs_dev_, masked_dev_, repack_rows_dev_, window_map_;
  // zipcache's compression: the groups to select in (SelectJob), each row's salient bit, the sets'
  // row lists, and a re-pack's output row of each decoded row.
  DeviceBuffer select_jobs_dev_, salient_dev_, set_list_dev_, repack_out_dev_;
  DeviceBuffer scratch_k_, scratch_v_, scratch_pos_, scratch_score_, scratch_expo_;  // a re-pack's decoded rows
  // Scratch sized by the rows spanned: given back after a prompt or question (release_span_scratch)
  // once its span is more than twice what the store can span now.
  mutable DeviceBuffer slot_of_;  // [H, span] int: each spanned row's slot (-1: padding / masked)
  mutable DeviceBuffer spanned_;  // [H, span] float: probabilities in spanned order (in or out of slot order)
  void release_span_scratch();
  // Grows `scratch` to H x head_bytes; a captured launch cannot allocate (InputError).
  void reserve_span_scratch(DeviceBuffer& scratch, std::size_t head_bytes, cudaStream_t stream) const;
};

}  // namespace kvslim::cuda
