// Device attention over a layer's storage: split-K (flash-decoding) kernels that read each kind's
// rows where they lie -- kivi codes (keys and values group-quantized per channel over groups of 32k
// tokens, each at its own width, bit-packed as on the CPU) and dense fp16/bf16 rows -- with every query head of a KV head
// (and, for S > 1, up to 8 query vectors) in one pass over the rows, fp32 accumulation, causal by
// true position. Partial results of every split are merged by combine(); the probabilities of an
// observation are computed from the logits the kernels leave behind when asked.
//
// Shapes: queries fp32 [B, S, Hq, D] (Hq = G * Hkv); out fp32 [B, S, Hq, D]; a KV head's query
// vectors m = s * G + j are taken 8 at a time (a "tile"); logits (optional) fp32
// [B * Hkv, S * G, rows_total] in log2 units; probs fp32 [B, Hkv, S, rows_total].
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cuda/cuda_common.cuh"

namespace kvslim::cuda {

constexpr int kTileRows = 8;    // query vectors per tile (rows g of the mma; g + 8 hold their low parts)
constexpr int kGroupRows = 32;  // rows per unit of the packed kernels (a quantization group is 1+ units)

constexpr int kInlinePositions = 16;  // query positions passed with the launch itself

struct QueryArgs {
  const float* q = nullptr;            // [B, S, Hq, D]
  const std::int64_t* qpos = nullptr;  // device [S] absolute positions of the query tokens, or null:
  std::int64_t qpos_inline[kInlinePositions] = {};  // ... these (S <= kInlinePositions)
  int B = 0, S = 0, Hq = 0, Hkv = 0, G = 0, D = 0;
  float scale_log2 = 0.f;              // logit scale * log2(e)
  const int* seq_rows = nullptr;       // optional device [B]: rows sequence b sees (its own length)
  float* logits = nullptr;             // optional [B * Hkv, S * G, rows_total]
  long long rows_total = 0;
  KVSLIM_HD int tiles() const { return (S * G + kTileRows - 1) / kTileRows; }
};

// Per split, per tile, per (b, h): unnormalised accumulators and (max, sum) of each tile row.
struct Partials {
  float* acc = nullptr;  // [parts, tiles, B * Hkv, 8, D]
  float* ml = nullptr;   // [parts, tiles, B * Hkv, 8, 2]
  int parts = 0;         // the call's parts (every segment's splits)
  // The merge inside the segments (fused_merge()): the last CTA of each (tile, b*h) to write its
  // partial -- counted in arrivals, which it resets -- merges all `parts` of them into out and
  // final_ml exactly as launch_combine would. Null arrivals: launch_combine merges.
  unsigned* arrivals = nullptr;  // [tiles, B * Hkv], zero between calls
  float* out = nullptr;          // [B, S, Hq, D]
  float* final_ml = nullptr;     // [B * Hkv, S * G, 2] or null
};

// Whether a call's segments merge their own partials (Partials::arrivals) instead of launching
// combine_kernel: one launch fewer per attention call, but measured slower (the last CTA of a head
// merges alone: 8 us more at batch 1 x 32k, 2 us at 8 x 32k on an H100, docs/cuda.md). Off unless
// KVSLIM_CUDA_FUSED_MERGE=1 (the benchmarks' A/B); set_fused_merge switches it for the calls that
// follow (tests).
bool fused_merge();
void set_fused_merge(bool on);

// kivi storage: n_units full units of 32 rows per (b, h), the kernels' unit of work. A quantization
// group is group_units consecutive units (kivi_group_size = 32 * group_units rows) with one fp16
// scale row and zero row; keys and values each at their own width (2, 4 or 8 bits).
struct PackedRows {
  const std::uint8_t* k_codes = nullptr;   // [B * Hkv, cap, k_row_bytes] (k_row_bytes = D * k_bits / 8)
  const std::uint8_t* v_codes = nullptr;   // [B * Hkv, cap, v_row_bytes]
  const std::uint16_t* k_params = nullptr; // fp16 [B * Hkv, cap / (32 * group_units), 2, D]: scale row, zero row
  const std::uint16_t* v_params = nullptr;
  long long k_codes_stride = 0;            // bytes between heads
  long long v_codes_stride = 0;
  long long params_stride = 0;             // elements between heads
  const std::int64_t* pos = nullptr;       // [cap] positions of the rows (the same for every head), or
  long long pos_head_stride = 0;           // [B * Hkv, pos_head_stride] when heads keep different rows
                                           // (zipcache's salient sets); INT64_MAX marks an empty slot
  int n_units = 0;                         // a multiple of group_units
  int group_units = 1;
  // Groups of varying length (zipcache's sets: a block's set ends in a shorter group): group_units
  // 1 (parameters stored per unit, repeated in each unit of a group) and unit_starts [n_units] (the
  // same for every head) nonzero where a group begins, so that the decode kernel reads a group's
  // parameters and builds its q' once (attend_codes_half.cu). null: groups of group_units.
  const std::uint8_t* unit_starts = nullptr;
  // Regions of an eviction store (DevicePackedRows: one group of 32 * group_units rows a region, its
  // rows at the front, the rest padding): [B * Hkv, region_rows_stride] the rows each holds now. The
  // decode kernel on the fp16 tensor cores neither loads nor computes a unit of padding only (set
  // for zipcache's sets, whose regions hold about half a group each). null: every unit is read.
  const int* region_rows = nullptr;
  long long region_rows_stride = 0;
  int k_bits = 0, v_bits = 0;
  int row_offset = 0;                      // cache row of the first row
};

// Dense rows (full's slots, a staging window): n_rows rows per (b, h).
struct DenseRows {
  const std::uint16_t* k = nullptr;        // [B * Hkv, stride, D] fp16 or bf16
  const std::uint16_t* v = nullptr;
  long long head_stride = 0;               // elements between heads (capacity * D, capacity % 16 == 0)
  const std::int64_t* pos = nullptr;       // [n_rows], or [B * Hkv, pos_head_stride] when heads keep different rows
  long long pos_head_stride = 0;           // 0: one position table for every head (nothing evicted per head)
  int n_rows = 0;
  DenseType type = DenseType::f16;
  int row_offset = 0;
  // false: within a unit of 16 rows the last is the newest (rows appended in position order, or
  // moved only among rows every query sees), so a unit whose last row the query sees needs no
  // per-row check. true (streaming: a new row may take an old row's slot mid-store): every row is
  // checked whenever some row may be newer than a query.
  bool unordered = false;
};

// An fp16 staging window [B * Hkv, capacity, D] read after `row_offset` rows of codes (kivi's
// window, the window of eviction over codes): positions [n_rows], or per head when
// pos_head_stride > 0 (rows masked per head, so every row is checked: unordered).
inline DenseRows staging_window_rows(const std::uint16_t* k, const std::uint16_t* v, const std::int64_t* pos,
                                     int capacity, int dim, int n_rows, int row_offset, long long pos_head_stride = 0) {
  DenseRows rows;
  rows.k = k;
  rows.v = v;
  rows.head_stride = static_cast<long long>(capacity) * dim;
  rows.pos = pos;
  rows.pos_head_stride = pos_head_stride;
  rows.n_rows = n_rows;
  rows.type = DenseType::f16;
  rows.row_offset = row_offset;
  rows.unordered = pos_head_stride > 0;
  return rows;
}

// The attention over a store of codes then an fp16 staging window (kivi, eviction over codes):
// both segments launch in every call, switched off while empty (a replayed step's graph holds
// both: kernel_launch.h); the window's parts follow the codes'. A captured step's graph runs the
// two side by side (step_graph.h: launch_side_by_side). Returns the parts written (count_only:
// just counts them).
int launch_codes_and_window(const QueryArgs& q, const PackedRows& codes, const DenseRows& window,
                            const Partials& parts, bool count_only, int sm_count, cudaStream_t stream);
// The same over zipcache's two sets of codes (DeviceZipCache, eviction over zipcache codes) and the
// window: the sets share one wave of CTAs (packed_splits_side_by_side); parts: hi's, lo's, the
// window's. A captured step's graph runs the hi set beside the lo set and the window.
int launch_sets_and_window(const QueryArgs& q, const PackedRows& hi, const PackedRows& lo, const DenseRows& window,
                           const Partials& parts, bool count_only, int sm_count, cudaStream_t stream);

// Splits each kernel would use for this much work (at least 1 when there are rows).
// (One full wave of resident CTAs: the kernel's occupancy decides.)
int packed_splits(const QueryArgs& q, const PackedRows& rows, int sm_count);
// Two stores of codes that run side by side (zipcache's salient rows and the rest): ONE wave of
// resident CTAs between them, in proportion to their units, each at least 1 while it has units
// (no more than packed_splits gives it alone). {splits of a, splits of b}.
std::pair<int, int> packed_splits_side_by_side(const QueryArgs& q, const PackedRows& a, const PackedRows& b,
                                               int sm_count);
int dense_splits(const QueryArgs& q, int n_rows, int sm_count, DenseType type);

// Launch on `stream`; each writes parts [part_base, part_base + splits). A segment after another
// segment of the same call (part_base > 0: kivi's window, zipcache's second set and window) launches
// early (programmatic dependent launch) and runs beside it: it reads nothing that segment writes,
// and waits for it before it exits; the first segment of a call never does, since it reads the
// queries the caller's previous kernel wrote.
void launch_packed(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                   cudaStream_t stream);
void launch_dense(const QueryArgs& q, const DenseRows& rows, const Partials& parts, int part_base, int splits,
                  cudaStream_t stream);
// Merges parts [0, n_parts) into out [B, S, Hq, D]; writes each query vector's final (max, sum)
// into final_ml [B * Hkv, S * G, 2] when given (probs need them).
void launch_combine(const QueryArgs& q, const Partials& parts, int n_parts, float* out, float* final_ml,
                    cudaStream_t stream);
// probs [B, Hkv, S, rows_total] = sum over the G query heads of exp2(logit - max) / sum.
void launch_probs(const QueryArgs& q, const float* final_ml, float* probs, cudaStream_t stream);

// Whether the kernels take this head_dim.
bool supported_head_dim(int D);

}  // namespace kvslim::cuda
