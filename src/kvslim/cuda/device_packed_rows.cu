#include "cuda/device_packed_rows.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "cuda/attend_shared.cuh"
#include "cuda/env_switch.h"
#include "cuda/group_quant.cuh"
#include "cuda/group_saliency.h"
#include "cuda/kernel_launch.h"
#include "cuda/lowest_candidate.cuh"
#include "cuda/select_lowest.h"
#include "cuda/step_graph.h"
#include "cuda/row_probability.cuh"
#include "kvslim/errors.h"
#include "kvslim/zipcache.h"
#include "quant/quant_kernels.h"

namespace kvslim::cuda {
namespace packed_jobs {

// The regions as the kernels write them.
struct RegionStore {
  std::uint8_t* k_codes = nullptr;  // [H, cap * G, k_rb]
  std::uint8_t* v_codes = nullptr;  // [H, cap * G, v_rb]
  std::uint16_t* k_params = nullptr;  // [H, cap, 2, D]
  std::uint16_t* v_params = nullptr;
  std::int64_t* pos = nullptr;        // [H, cap * G]
  float* score = nullptr;             // [H, cap * G] the policy's score mirror
  float* expo = nullptr;              // [H, cap * G] its exposure mirror, or null
  int capacity = 0, G = 0, D = 0, k_bits = 0, v_bits = 0;
  KVSLIM_HD long long region(int head, int r) const { return static_cast<long long>(head) * capacity + r; }
};

// A window buffer: fp16 rows [H, capacity, D] with positions and the policy's mirrors [H, capacity].
struct WindowRows {
  std::uint16_t* k = nullptr;
  std::uint16_t* v = nullptr;
  std::int64_t* pos = nullptr;
  float* score = nullptr;
  float* expo = nullptr;  // or null
  long long capacity = 0;
};

}  // namespace packed_jobs

namespace {

using packed_jobs::RegionStore;
using packed_jobs::WindowRows;

constexpr std::int64_t kEmpty = INT64_MAX;  // a padding row's position: every query masks it

// Where a compression reads its rows: fp16 [*, D] keys and values with their positions; row i of
// a job is (head * head_stride + list[i]) (head_stride 0: the list holds absolute rows).
struct RowSource {
  const std::uint16_t* k = nullptr;
  const std::uint16_t* v = nullptr;
  const std::int64_t* pos = nullptr;
  const float* score = nullptr;  // the policy's mirrors, travelling with the rows
  const float* expo = nullptr;   // (null: not kept)
  long long head_stride = 0;
};



using packed_jobs::CloseJob;
using packed_jobs::CompressJob;

// One group per (job, keys/values): D threads, one channel each -- the CPU quantizer's min / max
// over the group's rows, its fp16 parameters, the codes 32 rows at a time through shared memory
// into the CPU's plane layout (rows m.. of the region: code 0, position INT64_MAX). The codes are
// the m rows of list[list_at..]; the keys' parameters are theirs, the values' those of the vm rows
// of vlist[vlist_at..] (a zipcache set's values share the whole group's parameters). A set with no
// rows in the group gets parameters of an all-zero group (finite: its padding is read, then masked).
__global__ void compress_kernel(const CompressJob* jobs, const int* list, const int* vlist, RowSource src, RegionStore st) {
  extern __shared__ unsigned char codes[];  // [32][D]
  const CompressJob j = jobs[blockIdx.x];
  const int which = blockIdx.y, c = threadIdx.x, D = st.D, G = st.G;
  const int bits = which ? st.v_bits : st.k_bits, RB = D * bits / 8;
  const std::uint16_t* rows = which ? src.v : src.k;
  const long long base = static_cast<long long>(j.head) * src.head_stride;
  const auto value_at = [&](long long row) {
    const std::uint16_t h = rows[(base + row) * D + c];
    return __half2float(*reinterpret_cast<const __half*>(&h));
  };
  auto load = [&](int i) { return value_at(list[j.list_at + i]); };
  const int pm = which ? j.vm : j.m;  // rows the parameters are taken over
  float mn = pm > 0 ? INFINITY : 0.f, mx = pm > 0 ? -INFINITY : 0.f;
  for (int i = 0; i < pm; ++i) {
    const float x = which ? value_at(vlist[j.vlist_at + i]) : load(i);
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  std::uint16_t scale_h, zero_h;
  float scale_f, zero_f;
  make_params(mn, mx, bits, scale_h, zero_h, scale_f, zero_f);
  const long long region = st.region(j.head, j.region);
  std::uint16_t* params = (which ? st.v_params : st.k_params) + region * 2 * D;
  params[c] = scale_h;
  params[D + c] = zero_h;
  std::uint8_t* out = (which ? st.v_codes : st.k_codes) + region * G * RB;
  for (int u = 0; u < G / 32; ++u) {
    for (int r = 0; r < 32; ++r) {
      const int i = 32 * u + r;
      codes[r * D + c] = quantize_code(i < j.m ? load(i) : zero_f, zero_f, scale_f, bits);
    }
    __syncthreads();
    pack_unit(codes, D, bits, out + 32LL * u * RB);
    __syncthreads();
  }
  if (which == 0) {
    for (int r = c; r < G; r += blockDim.x) {
      const long long from = r < j.m ? base + list[j.list_at + r] : -1;
      st.pos[region * G + r] = from >= 0 ? src.pos[from] : kEmpty;
      st.score[region * G + r] = from >= 0 ? src.score[from] : 0.f;
      if (st.expo != nullptr) st.expo[region * G + r] = from >= 0 ? src.expo[from] : 0.f;
    }
  }
}

// zipcache's saliency inside one group to compress (the CPU's PackedRows::compress: row_norms_f16,
// then saliency_mask): its m rows list[list_at..] of `head` (m <= 1024), n_hi of them salient.
// Each row's salient bit goes to salient[bits_at + i] and its row to the hi set's list
// (set_list[hi_at..]) or the lo set's (set_list[lo_at..]), each in token order.
struct SelectJob {
  int head, m, list_at, n_hi, hi_at, lo_at, bits_at;
};

// One CTA a group: the warps take the rows' key norms in double, each lane a strided share of the
// channels summed by shuffles (zip_norms_kernel's order: every square of an fp16 value is exact in
// double, so the sums agree with the CPU's wherever they are exact); then thread i decides its row
// (salient_by_rank, group_saliency.h) and its place in its set is the same-set rows before it.
constexpr int kSelectThreads = 1024;
__global__ void __launch_bounds__(kSelectThreads)
    group_select_kernel(const SelectJob* jobs, const int* list, RowSource src, int D, int* set_list, std::uint8_t* salient) {
  __shared__ double norms[kSelectThreads];
  __shared__ std::uint8_t flag[kSelectThreads];
  const SelectJob j = jobs[blockIdx.x];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32, i = threadIdx.x;
  const long long base = static_cast<long long>(j.head) * src.head_stride;
  for (int r = warp; r < j.m; r += warps) {
    const std::uint16_t* key = src.k + (base + list[j.list_at + r]) * D;
    double acc = 0.0;
    for (int c = lane; c < D; c += 32) {
      const std::uint16_t h = key[c];
      const double x = __half2float(*reinterpret_cast<const __half*>(&h));
      acc += x * x;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) norms[r] = sqrt(acc);
  }
  __syncthreads();
  bool hi = false;
  if (i < j.m) {
    hi = salient_by_rank(norms, j.m, i, j.n_hi);
    flag[i] = hi ? 1 : 0;
  }
  __syncthreads();
  if (i >= j.m) return;
  int hi_before = 0;
  for (int r = 0; r < i; ++r) hi_before += flag[r];
  salient[j.bits_at + i] = hi ? 1 : 0;
  set_list[hi ? j.hi_at + hi_before : j.lo_at + (i - hi_before)] = list[j.list_at + i];
}

// One region per job, one CTA: its rows n_new taken from old offsets list[..] in order (each
// moves down or stays: a row at a time, so no copy reads a row an earlier one wrote), then rows
// n_new.. of the n_old become padding. Parameters stay: they are valid for every row that stays.
__global__ void close_region_kernel(const CloseJob* jobs, const int* list, RegionStore st) {
  const CloseJob j = jobs[blockIdx.x];
  const long long row0 = st.region(j.head, j.region) * st.G;
  const int k_rb = st.D * st.k_bits / 8, v_rb = st.D * st.v_bits / 8;
  for (int i = 0; i < j.n_new; ++i) {
    const int from = list[j.list_at + i];
    if (from == i) continue;
    for (int b = threadIdx.x; b < k_rb; b += blockDim.x) st.k_codes[(row0 + i) * k_rb + b] = st.k_codes[(row0 + from) * k_rb + b];
    for (int b = threadIdx.x; b < v_rb; b += blockDim.x) st.v_codes[(row0 + i) * v_rb + b] = st.v_codes[(row0 + from) * v_rb + b];
    if (threadIdx.x == 0) {
      st.pos[row0 + i] = st.pos[row0 + from];
      st.score[row0 + i] = st.score[row0 + from];
      if (st.expo != nullptr) st.expo[row0 + i] = st.expo[row0 + from];
    }
    __syncthreads();
  }
  for (int r = j.n_new + threadIdx.x; r < j.n_old; r += blockDim.x) st.pos[row0 + r] = kEmpty;
}

// Region r of head h of a new store from region map[h * cap_new + r] of the old one (-1: an empty
// region: zero codes and parameters, padding positions). 16-byte words: every part's size and
// offset is a multiple of 16 bytes.
__global__ void copy_regions_kernel(const int* map, RegionStore from, RegionStore to) {
  const int r = blockIdx.x, h = blockIdx.y, src = map[h * to.capacity + r];
  const long long dst_region = to.region(h, r), src_region = src < 0 ? 0 : from.region(h, src);
  auto copy = [&](const void* s, void* d, long long bytes) {
    const uint4* s4 = static_cast<const uint4*>(s);
    uint4* d4 = static_cast<uint4*>(d);
    for (long long i = threadIdx.x; i < bytes / 16; i += blockDim.x) d4[i] = src < 0 ? make_uint4(0, 0, 0, 0) : s4[i];
  };
  const int G = to.G, D = to.D, k_rb = D * to.k_bits / 8, v_rb = D * to.v_bits / 8;
  copy(from.k_codes + src_region * G * k_rb, to.k_codes + dst_region * G * k_rb, static_cast<long long>(G) * k_rb);
  copy(from.v_codes + src_region * G * v_rb, to.v_codes + dst_region * G * v_rb, static_cast<long long>(G) * v_rb);
  copy(from.k_params + src_region * 2 * D, to.k_params + dst_region * 2 * D, 4LL * D);
  copy(from.v_params + src_region * 2 * D, to.v_params + dst_region * 2 * D, 4LL * D);
  for (int i = threadIdx.x; i < G; i += blockDim.x) {
    to.pos[dst_region * G + i] = src < 0 ? kEmpty : from.pos[src_region * G + i];
    to.score[dst_region * G + i] = src < 0 ? 0.f : from.score[src_region * G + i];
    if (to.expo != nullptr) to.expo[dst_region * G + i] = src < 0 ? 0.f : from.expo[src_region * G + i];
  }
}

// A re-pack's first half: row out_at[i] of the output (i without out_at) = the stored row rows[i]
// (a flat row of the regions) decoded as the CPU decodes (fp16(code * scale + zero), no
// contraction), with its position.
__global__ void decode_rows_kernel(const long long* rows, const int* out_at, RegionStore st, std::uint16_t* k_out,
                                   std::uint16_t* v_out, std::int64_t* pos_out, float* score_out, float* expo_out) {
  const int c = threadIdx.x, D = st.D, i = out_at != nullptr ? out_at[blockIdx.x] : static_cast<int>(blockIdx.x);
  const long long row = rows[blockIdx.x], region = row / st.G;
  for (int which = 0; which < 2; ++which) {
    const int bits = which ? st.v_bits : st.k_bits, RB = D * bits / 8;
    const std::uint8_t byte = (which ? st.v_codes : st.k_codes)[row * RB + c % RB];
    const unsigned code = (byte >> ((c / RB) * bits)) & ((1u << bits) - 1u);
    const std::uint16_t* p = (which ? st.v_params : st.k_params) + region * 2 * D;
    const float scale = __half2float(*reinterpret_cast<const __half*>(p + c));
    const float zero = __half2float(*reinterpret_cast<const __half*>(p + D + c));
    const __half h = __float2half_rn(__fadd_rn(__fmul_rn(static_cast<float>(code), scale), zero));
    (which ? v_out : k_out)[static_cast<long long>(i) * D + c] = *reinterpret_cast<const std::uint16_t*>(&h);
  }
  if (c == 0) {
    pos_out[i] = st.pos[row];
    score_out[i] = st.score[row];
    if (expo_out != nullptr) expo_out[i] = st.expo[row];
  }
}

__global__ void mask_rows_kernel(const long long* rows, int n, std::int64_t* pos) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) pos[rows[i]] = kEmpty;
}



// Window rows 0..n of head h (one CTA, D threads) from rows map[h * n + i] of the same buffer, in
// place: the sources ascend and never lie below their destination, so moving one row at a time in
// order never reads a row already overwritten. -1: padding (masked).
__global__ void close_window_kernel(const int* map, int n, WindowRows w, int D) {
  const int h = blockIdx.x, c = threadIdx.x;
  const long long base = h * w.capacity;
  for (int i = 0; i < n; ++i) {
    const int src = map[h * n + i];
    if (src == i) continue;
    const long long dst = base + i, s = base + src;
    if (src >= 0) {
      w.k[dst * D + c] = w.k[s * D + c];
      w.v[dst * D + c] = w.v[s * D + c];
    }
    if (c == 0) {
      w.pos[dst] = src < 0 ? kEmpty : w.pos[s];
      w.score[dst] = src < 0 ? 0.f : w.score[s];
      if (w.expo != nullptr) w.expo[dst] = src < 0 ? 0.f : w.expo[s];
    }
    __syncthreads();
  }
}

// One decode step's observation over the codes (the eviction core's observe() for one query, then
// drop_lowest(1), as observe_decode_kernel over fp16 slots): grid (heads, parts) over the rows the
// attention spanned [regions | window]; padding and masked rows are skipped. Slot order is
// position order here (blocks and the window keep their rows in token order), so the sinks are the
// rows at or below the n_sink-th position. The victim leaves its group (the later rows move down,
// the group's parameters stay) or is masked in the window; victims[head] = its row (-1: none).
struct PackedObservation {
  const float* probs = nullptr;  // [H, probs_stride]: attention per spanned row (null: computed, below)
  long long probs_stride = 0;
  // A deferred step (DeviceCache::DeferredProbs; non-null logits): each spanned row's probability
  // computed from the attention's logits [H, G, probs_stride] and (max, sum) [H, G, 2] as attend's
  // probs kernel would (row_probability.cuh: the same bits), and written in slot order to
  // probs_out [H, out_stride] unless it is null (attend_and_observe: nobody reads them).
  float* probs_out = nullptr;
  const float* logits = nullptr;
  const float* final_ml = nullptr;
  int G = 1;
  long long out_stride = 0;
  RegionStore st[2];            // each set's regions (sets of them)
  int* tokens[2] = {nullptr, nullptr};  // [H, cap] rows of each region of each set
  int sets = 1;
  // probs_out in spanned order (two sets: slot order is not span order; the host orders them after)
  bool spanned_out = false;
  WindowRows w;
  int regions = 0, window_rows = 0, fresh_w = 0;  // spanned regions; window rows; first window row not yet observed
  const std::int64_t* sink_pos = nullptr;         // [H]
  int n_rows = 0, limit = 0;
  std::int64_t qpos = 0, threshold = 0;
  float decay = 1.f;
  int* victims = nullptr;  // [H]
};

// One overlapping move down, dst[i] = dst[i + shift] for i in [0, count), of a per-row array.
struct WordMove {
  std::uint32_t* dst;
  long long count;
  int shift;
};

// The moves of N disjoint arrays in one pass of the whole CTA: kWords words a thread are read into
// registers (the N arrays' words as one index space, ascending), then written: one read and one
// write for all the arrays instead of a round trip each (a group's row leaving K4V2 g128 moves 27
// words for each later row, at most ~3,400; one pass of 256 threads takes 3,072). A chunk's writes
// reach only words this or an earlier chunk has read.
// Inlined, the moves' pointers and counts are registers (a __noinline__ form kept them on the
// stack: four local loads before each word's global one, on the step's critical path -- only the
// last CTA of a head runs this, after every part has arrived).
template <int N>
__device__ __forceinline__ void move_words_down(const WordMove (&moves)[N]) {
  constexpr int kWords = 12;  // (16 spilled in observe_packed_kernel<4> under its 80-register bound)
  long long total = 0;
#pragma unroll
  for (int m = 0; m < N; ++m) total += moves[m].count;
  const long long T = blockDim.x;
  // Word i of the joint index space (i < total): its address; *shift: its array's shift.
  const auto locate = [&](long long i, int& shift) {
    std::uint32_t* dst = moves[0].dst;
    shift = moves[0].shift;
    bool found = false;
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
      found = found || i < moves[k].count;
      if (!found) {
        i -= moves[k].count;
        dst = moves[k + 1].dst;
        shift = moves[k + 1].shift;
      }
    }
    return dst + i;
  };
  for (long long c = 0; c < total; c += kWords * T) {
    std::uint32_t w[kWords];
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      const long long i = c + j * T + threadIdx.x;
      if (i < total) {
        int shift;
        const std::uint32_t* at = locate(i, shift);
        w[j] = __ldcg(at + shift);
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      const long long i = c + j * T + threadIdx.x;
      if (i < total) {
        int shift;
        *locate(i, shift) = w[j];
      }
    }
    __syncthreads();
  }
}

// kObserveRows: the consecutive rows a thread takes per chunk (below). Three CTAs an SM (at most
// 80 registers): ptxas's own choice gave the 1- and 2-row kernels 64 registers and spills, the
// 4-row one 111 (two CTAs an SM, measured 0.509 against 0.371 ms a step at 16 x 32k).
template <int kObserveRows>
__global__ void __launch_bounds__(kObserveThreads, 3)
    observe_packed_kernel(PackedObservation o, Candidate* part_best, unsigned* arrivals) {
  const int head = blockIdx.x, part = blockIdx.y, parts = gridDim.y, G = o.st[0].G;
  // A head's spanned rows are int (observe_decode checks): 32-bit divisions, not 64-bit ones (a
  // subroutine each) in every row's region and offset.
  // Spanned rows: each set's regions (set_rows each), then the window.
  const int set_rows = o.regions * G, region_rows = o.sets * set_rows, span = region_rows + o.window_rows;
  const int per = (span + parts - 1) / parts, first = part * per, end = min(span, first + per);
  const std::int64_t sink = o.sink_pos[head];
  const long long head_regions = static_cast<long long>(head) * o.st[0].capacity;
  const int* tokens_of_head = o.tokens[0] + head_regions;  // (slot order from the counts: one set only)
  const std::int64_t* wpos_of_head = o.w.pos + head * o.w.capacity;
  // Writing probabilities in slot order: a row's slot is the live rows before it, counted for this
  // part's first row here (each thread's share in `before`), then chunk by chunk (every thread runs
  // the same chunks). The first chunk's prefix sum also sums `before`: one scan, not two. Unwritten
  // (nobody reads them), there is no count and no scan.
  const bool from_logits = o.logits != nullptr, writes = o.probs_out != nullptr;
  const bool by_attention = from_logits || o.probs != nullptr;  // else by position: every row adds 0 (streaming)
  int before = 0;
  if (writes && !o.spanned_out) {
    const int whole = min(o.regions, first / G);
    for (int r = threadIdx.x; r < whole; r += blockDim.x) before += tokens_of_head[r];
    if (threadIdx.x == 0 && first < region_rows) before += min(first % G, tokens_of_head[first / G]);
    for (int wr = threadIdx.x; wr < first - region_rows; wr += blockDim.x) before += wpos_of_head[wr] != kEmpty ? 1 : 0;
  }
  // Launched early behind the attention's merge (programmatic dependent launch): the counts above
  // were written before the attention began; its logits' (max, sum) and the probabilities are read
  // only from here on.
  attend_detail::pdl_wait();
  int slot_base = -1;  // live rows before the current chunk's first row (every thread holds it; -1: not yet summed)
  // A thread takes kObserveRows consecutive rows of each chunk and issues all their loads (the
  // region's count, the metadata, the logits) before it uses any: one round trip to memory and one
  // prefix sum per chunk, not per row.
  const int chunk_rows = kObserveRows * blockDim.x;
  Candidate best{0.f, 0, -1};
  for (int chunk_first = first; chunk_first < end; chunk_first += chunk_rows) {
    const int i0 = chunk_first + static_cast<int>(threadIdx.x) * kObserveRows;
    long long at[kObserveRows];
    int set[kObserveRows];
    bool in_window[kObserveRows], live[kObserveRows];
    std::int64_t p[kObserveRows];
    float old_score[kObserveRows], old_expo[kObserveRows], prob[kObserveRows];
    int live_rows = 0;
#pragma unroll
    for (int j = 0; j < kObserveRows; ++j) {
      const int i = i0 + j;
      in_window[j] = i >= region_rows;
      live[j] = false;
      p[j] = kEmpty;
      old_score[j] = old_expo[j] = prob[j] = 0.f;
      at[j] = 0;
      set[j] = 0;
      if (i >= end) continue;
      bool fresh = false;
      if (!in_window[j]) {
        set[j] = i >= set_rows ? 1 : 0;
        const int local = i - set[j] * set_rows, r = local / G, off = local - r * G;
        at[j] = (head_regions + r) * G + off;
        live[j] = off < o.tokens[set[j]][head_regions + r];
      } else {
        at[j] = head * o.w.capacity + (i - region_rows);
        fresh = i - region_rows >= o.fresh_w;
      }
      const std::int64_t* pos = in_window[j] ? o.w.pos : o.st[set[j]].pos;
      const float* score = in_window[j] ? o.w.score : o.st[set[j]].score;
      const float* expo = in_window[j] ? o.w.expo : o.st[set[j]].expo;
      p[j] = pos[at[j]];
      if (!fresh) old_score[j] = score[at[j]];
      if (expo != nullptr && !fresh) old_expo[j] = expo[at[j]];
      prob[j] = from_logits      ? summed_probability(o.logits, o.final_ml, static_cast<long long>(head) * o.G, o.G, o.probs_stride, i)
                : by_attention ? o.probs[head * o.probs_stride + i]
                               : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kObserveRows; ++j) {
      if (in_window[j] && i0 + j < end) live[j] = p[j] != kEmpty;
      live_rows += live[j] ? 1 : 0;
    }
    if (writes && o.spanned_out) {
#pragma unroll
      for (int j = 0; j < kObserveRows; ++j) {
        if (i0 + j < end) o.probs_out[head * o.out_stride + i0 + j] = live[j] ? prob[j] : 0.f;
      }
    } else if (writes) {
      int slot = 0, chunk_live = 0;
      if constexpr (kObserveRows > 2) {  // long parts (many chunks): the base's own scan, once
        if (slot_base < 0) cta_exclusive_sum(before, &slot_base);
        slot = slot_base + cta_exclusive_sum(live_rows, &chunk_live);
      } else if (slot_base < 0) {  // the part's first chunk: (before, live rows) summed as one 64-bit
        // count (live rows per chunk <= 2 * kObserveThreads: never a carry into the high word)
        long long total = 0;
        const long long ahead = cta_exclusive_sum((static_cast<long long>(before) << 32) | live_rows, &total);
        slot_base = static_cast<int>(total >> 32);
        slot = slot_base + static_cast<int>(ahead & 0xFFFFFFFFLL);
        chunk_live = static_cast<int>(total & 0xFFFFFFFFLL);
      } else {
        slot = slot_base + cta_exclusive_sum(live_rows, &chunk_live);
      }
      slot_base += chunk_live;
#pragma unroll
      for (int j = 0; j < kObserveRows; ++j) {
        if (live[j]) o.probs_out[head * o.out_stride + slot++] = prob[j];
      }
    }
#pragma unroll
    for (int j = 0; j < kObserveRows; ++j) {
      if (!live[j]) continue;
      float* score = in_window[j] ? o.w.score : o.st[set[j]].score;
      float* expo = in_window[j] ? o.w.expo : o.st[set[j]].expo;
      float s = old_score[j];
      if (o.decay != 1.f) s = __fmul_rn(s, o.decay);
      s = __fadd_rn(s, prob[j]);
      score[at[j]] = s;
      float effective = s;
      if (expo != nullptr) {
        float e = old_expo[j];
        if (o.decay != 1.f) e = __fmul_rn(e, o.decay);
        e = __fadd_rn(e, p[j] <= o.qpos ? 1.f : 0.f);
        expo[at[j]] = e;
        effective = e > 0.f ? __fdiv_rn(s, e) : 0.f;
      }
      const Candidate c{effective, p[j], i0 + j};
      if (p[j] > sink && p[j] < o.threshold && lower(c, best)) best = c;
    }
  }
  if (o.n_rows <= o.limit) return;
  if (!head_lowest(best, part_best, arrivals, head, part, parts)) return;
  const int victim = best.slot;
  if (threadIdx.x == 0) o.victims[head] = victim;  // -1: none (the host names the logic error)
  if (victim < 0) return;  // validate() keeps the budget above the sinks and the window
  if (victim >= region_rows) {  // a window row: masked where it lies
    if (threadIdx.x == 0) o.w.pos[head * o.w.capacity + (victim - region_rows)] = kEmpty;
    return;
  }
  // A group's row: the later rows of its region move down one, the last becomes padding. Each
  // per-row array of the region (codes, positions, the mirrors) is contiguous there, so this is a
  // move of words by the whole CTA (the mirrors were written by other parts this step: read past L1).
  const int vs = victim >= set_rows ? 1 : 0, local = victim - vs * set_rows, r = local / G, off = local % G;
  const RegionStore& st = o.st[vs];
  int* tokens = o.tokens[vs] + head_regions + r;
  const int n = *tokens;
  const long long row0 = (head_regions + r) * G;
  const int k_rb = st.D * st.k_bits / 8, v_rb = st.D * st.v_bits / 8;  // (multiples of 4 bytes)
  const long long later = n - 1 - off;  // rows that move
  const auto words = [](auto* row) { return reinterpret_cast<std::uint32_t*>(row); };
  const bool has_expo = st.expo != nullptr;
  const WordMove moves[5] = {{words(st.k_codes + (row0 + off) * k_rb), later * k_rb / 4, k_rb / 4},
                             {words(st.v_codes + (row0 + off) * v_rb), later * v_rb / 4, v_rb / 4},
                             {words(st.pos + row0 + off), later * 2, 2},
                             {words(st.score + row0 + off), later, 1},
                             {has_expo ? words(st.expo + row0 + off) : nullptr, has_expo ? later : 0, 1}};
  move_words_down(moves);
  if (threadIdx.x == 0) {
    st.pos[row0 + n - 1] = kEmpty;
    *tokens = n - 1;
  }
}

// observe_packed_kernel's rows a thread per chunk for parts of per_part rows: the fewest of 1, 2, 4
// that take a part in one chunk, else 4. KVSLIM_CUDA_OBSERVE_ROWS=1|2|4 fixes it (the benchmarks'
// A/B of the choice; anything else is refused).
int observe_rows_a_thread(long long per_part) {
  static const int fixed = [] {
    const char* v = std::getenv("KVSLIM_CUDA_OBSERVE_ROWS");
    if (v == nullptr || *v == '\0') return 0;
    const std::string s(v);
    if (s == "1" || s == "2" || s == "4") return std::stoi(s);
    throw InputError("KVSLIM_CUDA_OBSERVE_ROWS: '" + s + "' is not 1, 2 or 4 rows a thread");
  }();
  if (fixed > 0) return fixed;
  for (int rows : {1, 2}) {
    if (per_part <= static_cast<long long>(rows) * kObserveThreads) return rows;
  }
  return 4;
}

// Whether the decode observation launches behind the attention's merge while it runs
// (programmatic dependent launch; the kernel waits before it reads the merge's output).
// KVSLIM_CUDA_OBSERVE_PDL=0 launches it after the merge (the benchmarks' A/B).
bool observe_launches_early() {
  static const bool early = env_switch("KVSLIM_CUDA_OBSERVE_PDL", true);
  return early;
}

// Whether the decode codes kernel is told each region's rows of a zipcache set, to skip the units
// of padding only. KVSLIM_CUDA_SKIP_PADDING=0 reads every unit (the benchmarks' A/B).
bool skips_padding() {
  static const bool skips = env_switch("KVSLIM_CUDA_SKIP_PADDING", true);
  return skips;
}

// A squeeze budget's trim while every row waits in the window (drop_lowest_on_device): each
// window row's selection key [heads, W] (select_lowest.h). Candidates are live rows above the sinks'
// positions and below the threshold; rows at or past `fresh_w` score 0 (the core's fresh rows). A
// candidate position outside [0, 2^32) sets *unkeyed (the host decides).
__global__ void window_keys_kernel(WindowRows w, int W, const std::int64_t* sink_pos, int fresh_w, std::int64_t threshold,
                                   std::uint64_t* keys, int* unkeyed) {
  const int head = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= W) return;
  const long long at = head * w.capacity + i;
  const std::int64_t p = w.pos[at];
  std::uint64_t key = kNotCandidate;
  if (p != kEmpty && p > sink_pos[head] && p < threshold) {
    if (p < 0 || p > 0xFFFFFFFFLL) {
      atomicOr(unkeyed, 1);
    } else {
      const bool fresh = i >= fresh_w;
      const float s = fresh ? 0.f : w.score[at];
      float effective = s;
      if (w.expo != nullptr) {
        const float e = fresh ? 0.f : w.expo[at];
        effective = e > 0.f ? __fdiv_rn(s, e) : 0.f;
      }
      key = selection_key(effective, p);
    }
  }
  keys[static_cast<long long>(head) * W + i] = key;
}

// The chosen rows (key <= the head's kth) masked in the window; gone [heads, W]: 1 for each.
__global__ void mask_window_victims_kernel(const std::uint64_t* keys, const std::uint64_t* kth, WindowRows w, int W,
                                           std::uint8_t* gone) {
  const int head = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= W) return;
  const bool victim = keys[static_cast<long long>(head) * W + i] <= kth[head];
  if (victim) w.pos[head * w.capacity + i] = kEmpty;
  gone[static_cast<long long>(head) * W + i] = victim ? 1 : 0;
}

// Each spanned row's slot (its index in slot order, -1: padding or masked) per head, from the
// device's own counts: slot order is block (region) order then window order, and inside a block
// token order, so a row's slot is the live rows of the regions before its own (a sum over their
// counts, then a prefix sum over the part's), then its index in its set plus, with two sets, the
// other set's rows of its region at a lower position (a binary search: each set's region holds its
// rows in token order), then the window's live rows. slot_of [H, span]; grid (H, parts): part p <
// last takes regions [p * part_regions, (p + 1) * part_regions), the last part the window (one CTA a
// head left 124 of an H100's 132 SMs idle: 78 us a layer at 1 x 32k).
struct SlotSets {
  const int* tokens[2] = {nullptr, nullptr};            // [H, capacity] each set's rows a region
  const std::int64_t* pos[2] = {nullptr, nullptr};      // [H, capacity * G]
  int sets = 1;
  // (selects, not a runtime index into the kernel's parameters: that copies them to the stack)
  __device__ const int* tokens_of(int s) const { return s == 0 ? tokens[0] : tokens[1]; }
  __device__ const std::int64_t* pos_of(int s) const { return s == 0 ? pos[0] : pos[1]; }
};
constexpr int kSlotPartRows = 512;  // rows of a set a part's regions hold (one region at least: G up to 1024)
__host__ __device__ inline int slot_part_regions(int G) { return G >= kSlotPartRows ? 1 : kSlotPartRows / G; }
__global__ void __launch_bounds__(kObserveThreads)
    slot_order_kernel(SlotSets ss, int capacity, int regions, int G, const std::int64_t* wpos, long long window_capacity,
                      int window_rows, int* slot_of) {
  const int h = blockIdx.x, tid = threadIdx.x;
  const long long set_rows = static_cast<long long>(regions) * G;
  const long long span = ss.sets * set_rows + window_rows;
  int* out = slot_of + h * span;
  const long long head_regions = static_cast<long long>(h) * capacity;
  const int part_regions = slot_part_regions(G);  // <= kObserveThreads
  const int r0 = static_cast<int>(blockIdx.y) * part_regions;
  const bool window_part = r0 >= regions;
  // The live rows of every region before this part's (all of them: the window's part).
  int before = 0;
  for (int r = tid; r < min(r0, regions); r += kObserveThreads) {
    for (int s = 0; s < ss.sets; ++s) before += ss.tokens_of(s)[head_regions + r];
  }
  int base = 0;
  cta_exclusive_sum(before, &base);
  if (window_part) {
    for (int c = 0; c < window_rows; c += kObserveThreads) {
      const int w = c + tid;
      const bool live = w < window_rows && wpos[h * window_capacity + w] != kEmpty;
      int chunk = 0;
      const int at = cta_exclusive_sum(live ? 1 : 0, &chunk);
      if (w < window_rows) out[ss.sets * set_rows + w] = live ? base + at : -1;
      base += chunk;
    }
    return;
  }
  __shared__ int region_rows[2][kObserveThreads], region_base[kObserveThreads];
  const int r = r0 + tid, n_regions = min(regions - r0, part_regions);
  int t = 0;
  for (int s = 0; s < ss.sets; ++s) {
    const int n = tid < n_regions ? ss.tokens_of(s)[head_regions + r] : 0;
    region_rows[s][tid] = n;
    t += n;
  }
  int chunk = 0;
  region_base[tid] = base + cta_exclusive_sum(t, &chunk);
  __syncthreads();
  const long long n = static_cast<long long>(n_regions) * G;
  for (int s = 0; s < ss.sets; ++s) {
    for (long long i = tid; i < n; i += kObserveThreads) {
      const int rr = static_cast<int>(i / G), off = static_cast<int>(i % G);
      int slot = -1;
      if (off < region_rows[s][rr]) {
        slot = region_base[rr] + off;
        if (ss.sets == 2) {  // the other set's rows of this region below this row's position
          const long long row0 = (head_regions + r0 + rr) * G;
          const std::int64_t p = ss.pos_of(s)[row0 + off];
          const std::int64_t* other = ss.pos_of(1 - s) + row0;
          int lo = 0, hi = region_rows[1 - s][rr];
          while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (other[mid] < p) lo = mid + 1; else hi = mid;
          }
          slot += lo;
        }
      }
      out[s * set_rows + static_cast<long long>(r0) * G + i] = slot;
    }
  }
}

// probs [H, S, rows] (slot order) from spanned [H, S, span] through slot_of [H, span].
__global__ void order_probs_kernel(const int* slot_of, const float* spanned, float* probs, long long n_hs, int S, int rows,
                                   long long span) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= span) return;
  for (long long hs = blockIdx.y; hs < n_hs; hs += gridDim.y) {
    const int slot = slot_of[(hs / S) * span + i];
    if (slot >= 0) probs[hs * rows + slot] = spanned[hs * span + i];
  }
}

// spanned [H, span] from probs in slot order [H, probs_stride] (padding and masked rows: 0).
__global__ void spread_probs_kernel(const int* slot_of, const float* probs, long long probs_stride, float* spanned,
                                    long long span) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int h = blockIdx.y;
  if (i >= span) return;
  const int slot = slot_of[h * span + i];
  spanned[h * span + i] = slot >= 0 ? probs[h * probs_stride + slot] : 0.f;
}

int round_up16(int x) { return (x + 15) / 16 * 16; }

template <typename T>
void upload(DeviceBuffer& buf, const std::vector<T>& host, cudaStream_t stream) {
  buf.upload(host.data(), host.size() * sizeof(T), stream);
}

[[noreturn]] void not_on_device(const char* what) { throw std::logic_error(std::string("DevicePackedRows: ") + what); }

// f(set, offset) for each row of a block in token order (offset: the row's place in its set's
// region, which holds that set's rows of the block in token order).
template <typename F>
void for_each_row(const DevicePackedRows::Block& b, F&& f) {
  int offset[2] = {0, 0};
  for (int t = 0; t < b.tokens; ++t) {
    const int set = b.set_of(t);
    f(set, offset[set]++);
  }
}

// Each set's groups quantized: jobs[set] (their codes rows in `list`, the value parameters over
// `vlist`) from src, both sets' jobs in one upload (jobs_dev), a launch a set.
void compress_sets(DeviceBuffer& jobs_dev, const std::vector<CompressJob> (&jobs)[2], int sets, const int* list,
                   const int* vlist, const RowSource& src, const RegionStore (&st)[2], int D, cudaStream_t stream) {
  std::vector<CompressJob> all = jobs[0];
  all.insert(all.end(), jobs[1].begin(), jobs[1].end());
  if (all.empty()) return;
  upload(jobs_dev, all, stream);
  std::size_t at = 0;
  for (int set = 0; set < sets; ++set) {
    const std::size_t n = jobs[set].size();
    launch_kernel(n > 0, false, compress_kernel, dim3(static_cast<unsigned>(std::max<std::size_t>(n, 1)), 2),
                  dim3(static_cast<unsigned>(D)), 32 * static_cast<std::size_t>(D), stream, jobs_dev.as<CompressJob>() + at,
                  list, vlist, src, st[set]);
    at += n;
  }
}

}  // namespace

namespace {
PackedLayout kivi_layout(int key_bits, int value_bits, int group_rows, int staging, bool with_exposure) {
  PackedLayout l;
  l.sets = 1;
  l.key_bits[0] = l.key_bits[1] = key_bits;
  l.value_bits = value_bits;
  l.group_rows = group_rows;
  l.staging = staging;
  l.with_exposure = with_exposure;
  return l;
}
}  // namespace

DevicePackedRows::DevicePackedRows(int key_bits, int value_bits, int group_rows, int staging, bool with_exposure)
    : DevicePackedRows(kivi_layout(key_bits, value_bits, group_rows, staging, with_exposure)) {}

DevicePackedRows::DevicePackedRows(const PackedLayout& layout)
    : layout_(layout),
      key_bits_(layout.key_bits[0]),
      value_bits_(layout.value_bits),
      group_rows_(layout.group_rows),
      staging_(std::max(layout.staging, 1)),
      with_exposure_(layout.with_exposure) {
  // KVCacheConfig::validate() has applied the device rules (widths 2/4/8, groups of 32-row units).
  if (group_rows_ % 32 != 0 || group_rows_ <= 0) throw std::logic_error("DevicePackedRows: group_rows must be a multiple of 32");
  if (group_rows_ > 1024) throw std::logic_error("DevicePackedRows: group_rows must be at most 1024");
  if (layout_.sets != 1 && layout_.sets != 2) throw std::logic_error("DevicePackedRows: one or two sets");
  if (!(layout_.hi_fraction >= 0.0 && layout_.hi_fraction <= 1.0)) throw std::logic_error("DevicePackedRows: hi_fraction in [0, 1]");
}

int DevicePackedRows::Block::rows_in(int set) const {
  if (salient.empty()) return set == 0 ? tokens : 0;
  int hi = 0;
  for (const std::uint8_t b : salient) hi += b;
  return set == 0 ? hi : tokens - hi;
}

DevicePackedRows::~DevicePackedRows() {
  if (victims_host_ != nullptr) cudaFreeHost(victims_host_);
}

void DevicePackedRows::begin(std::size_t heads_total, std::size_t dim) {
  heads_total_ = heads_total;
  dim_ = dim;
  for (int set = 0; set < 2; ++set) set_[set].k_rb = static_cast<int>(dim) * layout_.key_bits[set] / 8;
  v_rb_ = static_cast<int>(dim) * value_bits_ / 8;
  heads_.assign(heads_total, Head{});
}

RegionStore DevicePackedRows::regions(int set) const {
  const SetStore& st = set_[set];
  return RegionStore{st.k_codes.as<std::uint8_t>(), st.v_codes.as<std::uint8_t>(), st.k_params.as<std::uint16_t>(),
                     st.v_params.as<std::uint16_t>(), st.pos.as<std::int64_t>(), st.score.as<float>(),
                     with_exposure_ ? st.expo.as<float>() : nullptr, region_capacity_, group_rows_,
                     static_cast<int>(dim_), layout_.key_bits[set], value_bits_};
}

WindowRows DevicePackedRows::window(int which) const {
  return WindowRows{wk_[which].as<std::uint16_t>(), wv_[which].as<std::uint16_t>(), wpos_[which].as<std::int64_t>(),
                    wscore_[which].as<float>(), with_exposure_ ? wexpo_[which].as<float>() : nullptr, window_capacity_};
}

void DevicePackedRows::reserve_window(int which, int capacity) {
  const std::size_t rows = heads_total_ * static_cast<std::size_t>(capacity);
  wk_[which].reserve(rows * dim_ * 2);
  wv_[which].reserve(rows * dim_ * 2);
  wpos_[which].reserve(rows * sizeof(std::int64_t));
  wscore_[which].reserve(rows * sizeof(float));
  if (with_exposure_) wexpo_[which].reserve(rows * sizeof(float));
}

void DevicePackedRows::release_window(int which) {
  for (DeviceBuffer* b : {&wk_[which], &wv_[which], &wpos_[which], &wscore_[which], &wexpo_[which]}) b->release();
}

int DevicePackedRows::regions_used() const {
  int used = 0;
  for (const Head& h : heads_) {
    for (const Block& b : h.blocks) used = std::max(used, b.region + 1);
  }
  return used;
}

void DevicePackedRows::relayout(std::size_t, std::size_t keep) {
  apply_victims();
  for (const Head& h : heads_) {
    if (h.packed + h.window.size() > keep) throw std::logic_error("DevicePackedRows: relayout below the rows held");
  }
}

void DevicePackedRows::prepare(std::size_t incoming) {
  // (The window's rows are the host's to count: no victim is needed to place a row. A full ring is
  // read at the start of a step, eager or replayed alike, so both attend over the same regions.)
  if (static_cast<int>(pending_.size()) == kVictimRing) apply_victims();
  if (incoming > 1) flush_ = true;
  ensure_window(window_rows_ + static_cast<int>(incoming));
  DeviceRowStore::prepare(incoming);
}

void DevicePackedRows::place(const AppendInput& in, std::size_t, cudaStream_t stream) {
  StagingWindow w;
  w.k_out = wk_[cur_].as<std::uint16_t>();
  w.v_out = wv_[cur_].as<std::uint16_t>();
  w.pos_out = wpos_[cur_].as<std::int64_t>();
  w.capacity = window_capacity_;
  w.pos_head_stride = window_capacity_;
  launch_window_append(in, w, window_rows_, stream);
  for (Head& h : heads_) {
    for (int s = 0; s < in.S; ++s) h.window.push_back(window_rows_ + s);
  }
  fresh_w_ = window_rows_;
  window_rows_ += in.S;
}

void DevicePackedRows::write(std::size_t, std::size_t, const std::uint16_t*, const std::uint16_t*) {
  not_on_device("rows reach the device window through the append kernel, never one by one from the host");
}

void DevicePackedRows::move(std::size_t, std::size_t, std::size_t) {
  not_on_device("rows cannot move between slots (the core erases instead)");
}

void DevicePackedRows::erase(std::size_t head, std::span<const std::size_t> slots) {
  apply_victims();
  Head& h = heads_[head];
  // A group already rewritten by a recorded erasure is rewritten again from its new order.
  for (int set = 0; set < layout_.sets; ++set) {
    for (const CloseJob& j : closes_[set]) {
      if (j.head == static_cast<int>(head)) {
        flush();
        break;
      }
    }
  }
  std::size_t next = 0, first = 0;  // next slot to erase; the block's first slot
  bool dropped = false;
  for (Block& b : h.blocks) {
    const std::size_t end = first + static_cast<std::size_t>(b.tokens);
    if (next < slots.size() && slots[next] < end) {
      // Each set's kept rows, as offsets in that set's region (a block's rows lie in token order in
      // their set's region: a row's offset there is the earlier rows of its set).
      int list_at[2], kept[2] = {0, 0}, seen[2] = {0, 0};
      for (int set = 0; set < layout_.sets; ++set) list_at[set] = static_cast<int>(close_list_[set].size());
      std::vector<std::uint8_t> salient;
      std::size_t t = 0;  // the row's place in the block (for_each_row walks them in token order)
      for_each_row(b, [&](int set, int offset) {
        const std::size_t row = t++;
        seen[set] = offset + 1;
        if (next < slots.size() && slots[next] == first + row) {
          ++next;
          return;
        }
        close_list_[set].push_back(offset);
        ++kept[set];
        if (!b.salient.empty()) salient.push_back(b.salient[row]);
      });
      for (int set = 0; set < layout_.sets; ++set) {
        if (kept[set] != seen[set]) {
          closes_[set].push_back(CloseJob{static_cast<int>(head), b.region, seen[set], kept[set], list_at[set]});
        } else {
          close_list_[set].resize(static_cast<std::size_t>(list_at[set]));  // untouched: no job
        }
      }
      const int now = kept[0] + kept[1];
      h.packed -= static_cast<std::size_t>(b.tokens - now);
      b.tokens = now;
      if (!b.salient.empty()) b.salient = std::move(salient);
      dropped = dropped || now == 0;
    }
    first = end;
  }
  // Window rows: masked where they lie (the window is closed up after the next compression).
  std::vector<int> window;
  window.reserve(h.window.size());
  for (std::size_t i = 0; i < h.window.size(); ++i) {
    const std::size_t slot = first + i;
    if (next < slots.size() && slots[next] == slot) {
      ++next;
      masked_.push_back(static_cast<long long>(head) * window_capacity_ + h.window[i]);
      continue;
    }
    window.push_back(h.window[i]);
  }
  if (next != slots.size()) throw std::logic_error("DevicePackedRows: erase past the rows held");
  h.window = std::move(window);
  if (dropped) {
    for (const Block& b : h.blocks) h.made -= b.tokens == 0 ? static_cast<std::size_t>(b.made) : 0;
    std::erase_if(h.blocks, [](const Block& b) { return b.tokens == 0; });
  }
}

void DevicePackedRows::flush() {
  if (!masked_.empty()) {
    upload(masked_dev_, masked_, stream_);
    const int n = static_cast<int>(masked_.size());
    launch_kernel(true, false, mask_rows_kernel, dim3((n + 255) / 256), dim3(256), 0, stream_,
                  masked_dev_.as<long long>(), n, wpos_[cur_].as<std::int64_t>());
    masked_.clear();
  }
  if (!closes_[0].empty() || !closes_[1].empty()) {
    launch_closes();
    upload_tokens();
  }
}

void DevicePackedRows::launch_closes() {
  for (int set = 0; set < layout_.sets; ++set) {
    if (closes_[set].empty()) continue;
    // (a list's copy is ordered before the kernel that reads it; the next set's copy waits for it
    // on the stream, so one buffer serves both)
    upload(jobs_dev_, closes_[set], stream_);
    upload(list_dev_, close_list_[set].empty() ? std::vector<int>{0} : close_list_[set], stream_);
    launch_kernel(true, false, close_region_kernel, dim3(static_cast<unsigned>(closes_[set].size())), dim3(128), 0, stream_,
                  jobs_dev_.as<CloseJob>(), list_dev_.as<int>(), regions(set));
    closes_[set].clear();
    close_list_[set].clear();
  }
}

void DevicePackedRows::upload_tokens() {
  const std::size_t cap = static_cast<std::size_t>(std::max(region_capacity_, 1));
  for (int set = 0; set < layout_.sets; ++set) {
    std::vector<int> tokens(heads_total_ * cap, 0);
    for (std::size_t head = 0; head < heads_.size(); ++head) {
      for (const Block& b : heads_[head].blocks) tokens[head * cap + b.region] = b.rows_in(set);
    }
    upload(set_[set].tokens, tokens, stream_);
  }
}

void DevicePackedRows::settle(std::size_t rows, const Saliency&) {
  apply_victims();
  flush();
  const int G = group_rows_;
  const std::size_t H = heads_.size();
  for (const Head& h : heads_) {
    if (h.packed + h.window.size() != rows) throw std::logic_error("DevicePackedRows: the policy and the storage disagree on the rows held");
  }
  // Re-packs first (the CPU's order): heads whose groups fell under a quarter of the rows they were
  // made with.
  bool changed = false;
  for (std::size_t head = 0; head < H; ++head) {
    const Head& h = heads_[head];
    if (h.blocks.size() >= 4 && 4 * h.packed < h.made) {
      repack(head);
      changed = true;
    }
  }
  // New blocks per head (a prompt's survivors whole; decode rows once `staging` wait).
  std::vector<int> count(H, 0);
  int needed = 0;
  bool gapped = false;
  for (std::size_t head = 0; head < H; ++head) {
    const Head& h = heads_[head];
    const int waiting = static_cast<int>(h.window.size());
    if (flush_ && waiting > 0) {
      count[head] = waiting;
    } else if (waiting >= staging_) {
      count[head] = staging_ >= G ? waiting / G * G : waiting;
    }
    needed = std::max(needed, static_cast<int>(h.blocks.size()) + (count[head] + G - 1) / G);
    for (std::size_t i = 0; i < h.blocks.size(); ++i) gapped = gapped || h.blocks[i].region != static_cast<int>(i);
  }
  const bool whole_call = flush_;
  flush_ = false;
  // Room for an eighth more groups (a re-layout is a copy of the store: the heads' block counts grow
  // at different steps); a store a quarter too large (evictions emptied groups) shrinks.
  const bool resize = needed > region_capacity_ || region_capacity_ > needed + needed / 4 + 1;
  if (gapped || resize) {
    relayout_regions(resize ? needed + needed / 8 + 1 : region_capacity_);
    changed = true;
  }
  // A group a job: kivi's rows all in set 0; zipcache's chosen on the device (SelectJob: the rows'
  // key norms, the hi_fraction with the largest salient), each set's rows listed in set_list.
  std::vector<CompressJob> jobs[2];
  std::vector<SelectJob> selects;
  std::vector<int> list;
  std::vector<std::pair<int, int>> made_blocks;  // (head, block index) of each job, in job order
  int set_rows = 0;                              // rows of set_list (zipcache)
  for (std::size_t head = 0; head < H; ++head) {
    Head& h = heads_[head];
    if (count[head] == 0) continue;
    for (int first = 0; first < count[head]; first += G) {
      const int m = std::min(G, count[head] - first), region = static_cast<int>(h.blocks.size());
      const int at = static_cast<int>(list.size());
      if (layout_.sets == 1) {
        jobs[0].push_back(CompressJob{static_cast<int>(head), region, m, at, m, at});
      } else {
        const int n_hi = static_cast<int>(salient_count(static_cast<std::size_t>(m), layout_.hi_fraction));
        selects.push_back(SelectJob{static_cast<int>(head), m, at, n_hi, set_rows, set_rows + n_hi, at});
        jobs[0].push_back(CompressJob{static_cast<int>(head), region, n_hi, set_rows, m, at});
        jobs[1].push_back(CompressJob{static_cast<int>(head), region, m - n_hi, set_rows + n_hi, m, at});
        set_rows += m;
      }
      list.insert(list.end(), h.window.begin() + first, h.window.begin() + first + m);
      h.blocks.push_back(Block{region, m, m, {}});
      made_blocks.emplace_back(static_cast<int>(head), region);
      h.made += static_cast<std::size_t>(m);
    }
    h.packed += static_cast<std::size_t>(count[head]);
    // The compressed rows leave the window (masked after the compression has read them; the window
    // is closed up below unless another head still holds as many rows).
    for (int i = 0; i < count[head]; ++i) {
      masked_.push_back(static_cast<long long>(head) * window_capacity_ + h.window[static_cast<std::size_t>(i)]);
    }
    h.window.erase(h.window.begin(), h.window.begin() + count[head]);
  }
  if (!list.empty()) {
    upload(list_dev_, list, stream_);
    const WindowRows w = window(cur_);
    const RowSource src{w.k, w.v, w.pos, w.score, w.expo, window_capacity_};
    const RegionStore st[2] = {regions(0), regions(layout_.sets - 1)};
    const int* codes_list = list_dev_.as<int>();
    if (!selects.empty()) {
      upload(select_jobs_dev_, selects, stream_);
      set_list_dev_.reserve(list.size() * sizeof(int), stream_);
      salient_dev_.reserve(list.size(), stream_);
      launch_kernel(true, false, group_select_kernel, dim3(static_cast<unsigned>(selects.size())), dim3(kSelectThreads), 0,
                    stream_, select_jobs_dev_.as<SelectJob>(), list_dev_.as<int>(), src, static_cast<int>(dim_),
                    set_list_dev_.as<int>(), salient_dev_.as<std::uint8_t>());
      codes_list = set_list_dev_.as<int>();
    }
    compress_sets(jobs_dev_, jobs, layout_.sets, codes_list, list_dev_.as<int>(), src, st, static_cast<int>(dim_), stream_);
    if (!selects.empty()) {
      std::vector<int> rows;
      for (const SelectJob& j : selects) rows.push_back(j.m);
      read_saliency(made_blocks, rows);
    }
    close_window();
    changed = true;
  }
  if (changed) upload_tokens();
  if (whole_call) release_span_scratch();
}

void DevicePackedRows::read_saliency(const std::vector<std::pair<int, int>>& job_blocks, const std::vector<int>& job_rows) {
  std::size_t total = 0;
  for (const int m : job_rows) total += static_cast<std::size_t>(m);
  std::vector<std::uint8_t> bits(total);
  // (once a compression, every staging rows of a decode: the host's lists must know each row's set)
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(bits.data(), salient_dev_.get(), total, cudaMemcpyDeviceToHost, stream_));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::size_t at = 0;
  for (std::size_t i = 0; i < job_blocks.size(); ++i) {
    Block& b = heads_[static_cast<std::size_t>(job_blocks[i].first)].blocks[static_cast<std::size_t>(job_blocks[i].second)];
    const std::size_t m = static_cast<std::size_t>(job_rows[i]);
    b.salient.assign(bits.begin() + static_cast<std::ptrdiff_t>(at), bits.begin() + static_cast<std::ptrdiff_t>(at + m));
    at += m;
  }
}

void DevicePackedRows::repack(std::size_t head) {
  Head& h = heads_[head];
  const int G = group_rows_, n = static_cast<int>(h.packed), sets = layout_.sets;
  // The head's rows decoded (fp16, as the CPU's decode_head) into scratch in token order, then
  // quantized again in full groups into regions 0..; its other regions become empty. Each row keeps
  // its set (the CPU's re-pack keeps every row's precision).
  std::vector<long long> rows[2];
  std::vector<int> out_at[2];
  std::vector<std::uint8_t> salient;  // zipcache: every row's bit, token order
  int old_top = 0, row = 0;
  for (const Block& b : h.blocks) {
    const long long region_row0 = (static_cast<long long>(head) * region_capacity_ + b.region) * G;
    for_each_row(b, [&](int set, int r) {
      rows[set].push_back(region_row0 + r);
      out_at[set].push_back(row++);
    });
    salient.insert(salient.end(), b.salient.begin(), b.salient.end());  // (empty unless zipcache)
    old_top = std::max(old_top, b.region + 1);
  }
  const std::size_t N = static_cast<std::size_t>(std::max(n, 1));
  scratch_k_.reserve(N * dim_ * 2);
  scratch_v_.reserve(N * dim_ * 2);
  scratch_pos_.reserve(N * sizeof(std::int64_t));
  scratch_score_.reserve(N * sizeof(float));
  if (with_exposure_) scratch_expo_.reserve(N * sizeof(float));
  float* scratch_expo = with_exposure_ ? scratch_expo_.as<float>() : nullptr;
  std::vector<long long> all_rows = rows[0];
  all_rows.insert(all_rows.end(), rows[1].begin(), rows[1].end());
  std::vector<int> all_out = out_at[0];
  all_out.insert(all_out.end(), out_at[1].begin(), out_at[1].end());
  upload(repack_rows_dev_, all_rows, stream_);
  upload(repack_out_dev_, all_out, stream_);
  for (int set = 0, at = 0; set < sets; ++set) {
    const int m = static_cast<int>(rows[set].size());
    launch_kernel(m > 0, false, decode_rows_kernel, dim3(static_cast<unsigned>(std::max(m, 1))), dim3(static_cast<unsigned>(dim_)),
                  0, stream_, repack_rows_dev_.as<long long>() + at, repack_out_dev_.as<int>() + at, regions(set),
                  scratch_k_.as<std::uint16_t>(), scratch_v_.as<std::uint16_t>(), scratch_pos_.as<std::int64_t>(),
                  scratch_score_.as<float>(), scratch_expo);
    at += m;
  }
  // New groups of G rows in token order: each set's rows of a group listed (scratch rows) in
  // set_lists, the whole group (for the value parameters) in `whole`.
  std::vector<CompressJob> jobs[2];
  std::vector<int> set_lists, whole(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) whole[static_cast<std::size_t>(i)] = i;
  std::vector<Block> blocks;
  for (int first = 0; first < n; first += G) {
    const int m = std::min(G, n - first), region = static_cast<int>(blocks.size());
    Block b{region, m, m, {}};
    int at[2], count[2] = {0, 0};
    at[0] = static_cast<int>(set_lists.size());
    for (int set = 0; set < sets; ++set) {
      if (set == 1) at[1] = static_cast<int>(set_lists.size());
      for (int t = first; t < first + m; ++t) {
        const int in = salient.empty() || salient[static_cast<std::size_t>(t)] != 0 ? 0 : 1;
        if (in != set) continue;
        set_lists.push_back(t);
        ++count[set];
      }
      jobs[set].push_back(CompressJob{static_cast<int>(head), region, count[set], at[set], m, first});
    }
    if (!salient.empty()) b.salient.assign(salient.begin() + first, salient.begin() + first + m);
    blocks.push_back(std::move(b));
  }
  if (!blocks.empty()) {
    upload(list_dev_, set_lists, stream_);
    upload(set_list_dev_, whole, stream_);
    const RowSource src{scratch_k_.as<std::uint16_t>(), scratch_v_.as<std::uint16_t>(), scratch_pos_.as<std::int64_t>(),
                        scratch_score_.as<float>(), scratch_expo, 0};
    const RegionStore st[2] = {regions(0), regions(sets - 1)};
    compress_sets(jobs_dev_, jobs, sets, list_dev_.as<int>(), set_list_dev_.as<int>(), src, st, static_cast<int>(dim_), stream_);
  }
  for (int set = 0; set < sets; ++set) {
    for (int r = static_cast<int>(blocks.size()); r < old_top; ++r) closes_[set].push_back(CloseJob{static_cast<int>(head), r, G, 0, 0});
  }
  launch_closes();
  h.blocks = std::move(blocks);
  h.made = h.packed;
  ++h.repacks;
  // The scratch stays until the stream has used it (it goes with the next re-layout).
}

void DevicePackedRows::relayout_regions(int capacity) {
  if (capturing_) throw InputError(std::string(kind()) + " storage (cuda): a captured step would re-lay out the store (decode eagerly)");
  const std::size_t H = heads_total_, G = static_cast<std::size_t>(group_rows_), D = dim_;
  const std::size_t cap = static_cast<std::size_t>(std::max(capacity, 1));
  std::vector<int> map(H * cap, -1);
  for (std::size_t head = 0; head < H; ++head) {
    std::vector<Block>& blocks = heads_[head].blocks;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      map[head * cap + i] = blocks[i].region;
      blocks[i].region = static_cast<int>(i);
    }
  }
  DeviceBuffer map_dev;
  upload(map_dev, map, stream_);
  SetStore next[2];
  for (int set = 0; set < layout_.sets; ++set) {
    SetStore& to = next[set];
    to.k_rb = set_[set].k_rb;
    to.k_codes.reserve(H * cap * G * static_cast<std::size_t>(to.k_rb));
    to.v_codes.reserve(H * cap * G * static_cast<std::size_t>(v_rb_));
    to.k_params.reserve(H * cap * 2 * D * 2);
    to.v_params.reserve(H * cap * 2 * D * 2);
    to.pos.reserve(H * cap * G * sizeof(std::int64_t));
    to.score.reserve(H * cap * G * sizeof(float));
    if (with_exposure_) to.expo.reserve(H * cap * G * sizeof(float));
    const RegionStore dst{to.k_codes.as<std::uint8_t>(), to.v_codes.as<std::uint8_t>(), to.k_params.as<std::uint16_t>(),
                          to.v_params.as<std::uint16_t>(), to.pos.as<std::int64_t>(), to.score.as<float>(),
                          with_exposure_ ? to.expo.as<float>() : nullptr, static_cast<int>(cap), group_rows_,
                          static_cast<int>(D), layout_.key_bits[set], value_bits_};
    launch_kernel(true, false, copy_regions_kernel, dim3(static_cast<unsigned>(cap), static_cast<unsigned>(H)), dim3(256), 0,
                  stream_, map_dev.as<int>(), regions(set), dst);
  }
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the old store (and the map) go
  for (int set = 0; set < layout_.sets; ++set) {
    for (auto [from, to] : {std::pair{&next[set].k_codes, &set_[set].k_codes}, std::pair{&next[set].v_codes, &set_[set].v_codes},
                            std::pair{&next[set].k_params, &set_[set].k_params}, std::pair{&next[set].v_params, &set_[set].v_params},
                            std::pair{&next[set].pos, &set_[set].pos}, std::pair{&next[set].score, &set_[set].score},
                            std::pair{&next[set].expo, &set_[set].expo}}) {
      *to = std::move(*from);
    }
  }
  region_capacity_ = static_cast<int>(cap);
  for (DeviceBuffer* b : {&scratch_k_, &scratch_v_, &scratch_pos_, &scratch_score_, &scratch_expo_}) b->release();
  upload_tokens();
}

void DevicePackedRows::resize_window(int capacity) {
  if (capturing_) throw InputError(std::string(kind()) + " storage (cuda): a captured step would re-allocate the window (decode eagerly)");
  const std::size_t H = heads_total_, D = dim_, cap = static_cast<std::size_t>(capacity);
  const int other = 1 - cur_;
  reserve_window(other, capacity);
  if (window_rows_ > 0) {
    const std::size_t old = static_cast<std::size_t>(window_capacity_), n = static_cast<std::size_t>(window_rows_);
    const auto copy = [&](DeviceBuffer* to, const DeviceBuffer* from, std::size_t elem) {
      KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(to->get(), cap * elem, from->get(), old * elem, n * elem, H,
                                          cudaMemcpyDeviceToDevice, stream_));
    };
    copy(&wk_[other], &wk_[cur_], D * 2);
    copy(&wv_[other], &wv_[cur_], D * 2);
    copy(&wpos_[other], &wpos_[cur_], 8);
    copy(&wscore_[other], &wscore_[cur_], 4);
    if (with_exposure_) copy(&wexpo_[other], &wexpo_[cur_], 4);
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the old window goes
  }
  release_window(cur_);
  cur_ = other;
  window_capacity_ = capacity;
}

void DevicePackedRows::ensure_window(int needed) {
  if (needed <= window_capacity_) return;
  // Rows masked since the window was last closed up may make room; it grows only past them (32
  // rows of room at a time: a decode step's window grows by one row).
  close_window();
  if (needed > window_capacity_) resize_window(round_up16(needed + 32));
}

void DevicePackedRows::close_window() {
  apply_victims();  // a pending victim is an index into the window as it is now
  flush();  // masked rows are indices into the current buffer
  int live = 0;
  for (const Head& h : heads_) live = std::max(live, static_cast<int>(h.window.size()));
  if (live == window_rows_) return;  // nothing to close up
  const std::size_t H = heads_total_, D = dim_;
  std::vector<int> map(H * static_cast<std::size_t>(std::max(live, 1)), -1);
  for (std::size_t head = 0; head < H; ++head) {
    std::vector<int>& w = heads_[head].window;
    for (std::size_t i = 0; i < w.size(); ++i) {
      map[head * static_cast<std::size_t>(live) + i] = w[i];
      w[i] = static_cast<int>(i);
    }
  }
  // In place (each row moves down, in order): no second buffer, no wait.
  upload(window_map_, map, stream_);
  launch_kernel(live > 0, false, close_window_kernel, dim3(static_cast<unsigned>(H)), dim3(static_cast<unsigned>(D)), 0,
                stream_, window_map_.as<int>(), live, window(cur_), static_cast<int>(D));
  window_rows_ = live;
  fresh_w_ = live;  // (closed up only after an observation: no row is unobserved)
  // A prompt's room is given back (a copy, once).
  const int room = round_up16(live + 32);
  if (window_capacity_ > 2 * room) resize_window(room);
}

int DevicePackedRows::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, std::size_t,
                                      bool, int sm_count, cudaStream_t stream) const {
  const int R = regions_used();
  // The window's masked rows may sit before live ones (positions per head: unordered).
  const DenseRows window = staging_window_rows(wk_[cur_].as<std::uint16_t>(), wv_[cur_].as<std::uint16_t>(),
                                               wpos_[cur_].as<std::int64_t>(), window_capacity_, static_cast<int>(dim_),
                                               window_rows_, layout_.sets * R * group_rows_, window_capacity_);
  if (layout_.sets == 1) return launch_codes_and_window(q, packed_rows(R), window, parts, count_only, sm_count, stream);
  // zipcache: the two sets share one wave of CTAs and run side by side with the window, as
  // DeviceZipCache's sets do (their rows one after the other in the spanned order).
  return launch_sets_and_window(q, packed_rows(R, 0), packed_rows(R, 1), window, parts, count_only, sm_count, stream);
}

int DevicePackedRows::parts_at_capacity(const QueryArgs& q, int sm_count) const {
  const int window = dense_splits(q, std::max(window_capacity_, 1), sm_count, DenseType::f16);
  if (region_capacity_ == 0) return window;
  if (layout_.sets == 1) return packed_splits(q, packed_rows(region_capacity_), sm_count) + window;
  const auto [hs, ls] = packed_splits_side_by_side(q, packed_rows(region_capacity_, 0), packed_rows(region_capacity_, 1), sm_count);
  return hs + ls + window;
}

PackedRows DevicePackedRows::packed_rows(int regions, int set) const {
  const int G = group_rows_;
  const SetStore& st = set_[set];
  PackedRows rows;
  rows.k_codes = st.k_codes.as<std::uint8_t>();
  rows.v_codes = st.v_codes.as<std::uint8_t>();
  rows.k_params = st.k_params.as<std::uint16_t>();
  rows.v_params = st.v_params.as<std::uint16_t>();
  rows.k_codes_stride = static_cast<long long>(region_capacity_) * G * st.k_rb;
  rows.v_codes_stride = static_cast<long long>(region_capacity_) * G * v_rb_;
  rows.params_stride = static_cast<long long>(region_capacity_) * 2 * static_cast<long long>(dim_);
  rows.pos = st.pos.as<std::int64_t>();
  rows.pos_head_stride = static_cast<long long>(region_capacity_) * G;
  rows.n_units = regions * G / 32;
  rows.group_units = G / 32;
  rows.k_bits = layout_.key_bits[set];
  rows.v_bits = value_bits_;
  rows.row_offset = set * regions * G;  // the spanned rows: set 0's regions, set 1's, the window
  // Two sets: the decode kernel skips units of padding only (a set's region holds its share of a
  // group, so about half its units are padding: 8 x 32k, h2o 25 % over zipcache, the sets' kernels
  // 0.970 -> 0.668 ms a step). One set (kivi) reads every unit: its regions are mostly full, and the
  // skipping form measured slower there (1 x 32k K4V2 g128 0.066 -> 0.073 ms; device_s54/r6).
  rows.region_rows = layout_.sets == 2 && skips_padding() ? st.tokens.as<int>() : nullptr;
  rows.region_rows_stride = region_capacity_;
  return rows;
}

long long DevicePackedRows::attention_rows(std::size_t) const {
  return static_cast<long long>(layout_.sets) * regions_used() * group_rows_ + window_rows_;
}

void DevicePackedRows::launch_slot_order(cudaStream_t stream) const {
  const std::size_t H = heads_total_;
  const int R = regions_used();
  const long long span = attention_rows(0);
  // A replayed step spans at most attention_rows_capacity() rows: reserve_next_step sized the
  // scratch to that before the capture and before every re-arm (a capture cannot allocate).
  reserve_span_scratch(slot_of_, static_cast<std::size_t>(span) * sizeof(int), stream);
  SlotSets ss;
  ss.sets = layout_.sets;
  for (int set = 0; set < layout_.sets; ++set) {
    ss.tokens[set] = set_[set].tokens.as<int>();
    ss.pos[set] = set_[set].pos.as<std::int64_t>();
  }
  if (slot_of_.bytes() < H * static_cast<std::size_t>(span) * sizeof(int)) slot_of_.reserve(H * static_cast<std::size_t>(span) * sizeof(int));
  const int part_regions = slot_part_regions(group_rows_);
  const unsigned parts = static_cast<unsigned>((R + part_regions - 1) / part_regions + 1);  // + the window's
  launch_kernel(span > 0, false, slot_order_kernel, dim3(static_cast<unsigned>(H), parts), dim3(kObserveThreads), 0, stream,
                ss, region_capacity_, R, group_rows_, wpos_[cur_].as<std::int64_t>(),
                static_cast<long long>(window_capacity_), window_rows_, slot_of_.as<int>());
}

void DevicePackedRows::order_probs(const float* spanned, float* probs, int S, std::size_t rows, cudaStream_t stream) const {
  const std::size_t H = heads_total_;
  if (rows == 0 || S == 0) return;
  launch_slot_order(stream);
  const long long n_hs = static_cast<long long>(H) * S, span = attention_rows(rows);
  launch_kernel(true, false, order_probs_kernel,
                dim3(static_cast<unsigned>((span + 255) / 256), static_cast<unsigned>(std::min(n_hs, 65535LL))), dim3(256),
                0, stream, slot_of_.as<int>(), spanned, probs, n_hs, S, static_cast<int>(rows), span);
}

void DevicePackedRows::observe_decode(const DecodeStep& step, void* part_best, unsigned* arrivals, std::size_t parts,
                                      cudaStream_t stream) {
  stream_ = stream;
  // (prepare read a full ring at the start of the step: the slot written now is free.)
  if (static_cast<int>(pending_.size()) == kVictimRing) throw std::logic_error("DevicePackedRows: the victims' ring is full");
  const std::size_t H = heads_total_;
  const int R = regions_used();
  const long long span = attention_rows(0);
  if (span > INT_MAX) {
    throw InputError(std::string(kind()) + " storage (cuda): a decode step would observe " + std::to_string(span) +
                     " rows of one head (at most 2^31 - 1)");
  }
  const float* probs = step.probs;
  long long stride = step.probs_stride;
  if (step.logits != nullptr) {
    probs = nullptr;
    stride = span;  // the logits' rows
  } else if (step.slot_order && span != static_cast<long long>(step.rows)) {
    // Probabilities in slot order (not this store's attend's): into the spanned order first.
    launch_slot_order(stream);
    reserve_span_scratch(spanned_, static_cast<std::size_t>(span) * sizeof(float), stream);
    launch_kernel(true, false, spread_probs_kernel, dim3(static_cast<unsigned>((span + 255) / 256), static_cast<unsigned>(H)),
                  dim3(256), 0, stream, slot_of_.as<int>(), step.probs, stride, spanned_.as<float>(), span);
    probs = spanned_.as<float>();
    stride = span;
  }
  if (victims_.bytes() < kVictimRing * H * sizeof(int)) {
    if (capturing_) throw InputError(std::string(kind()) + " storage (cuda): a captured step would allocate its victims' ring (decode one step eagerly first)");
    victims_.reserve(kVictimRing * H * sizeof(int));
  }
  const bool evicts = step.rows > step.limit;
  PackedObservation o;
  o.probs = probs;
  o.probs_stride = stride;
  o.probs_out = step.probs_out;
  o.logits = step.logits;
  o.final_ml = step.final_ml;
  o.G = step.G;
  o.out_stride = step.out_stride;
  o.sets = layout_.sets;
  for (int set = 0; set < layout_.sets; ++set) {
    o.st[set] = regions(set);
    o.tokens[set] = set_[set].tokens.as<int>();
  }
  // Two sets and probabilities to write: the kernel writes them in spanned order into spanned_,
  // ordered into probs_out after it (order_probs_kernel over the slot order).
  const bool order_after = layout_.sets == 2 && step.probs_out != nullptr;
  if (order_after) {
    reserve_span_scratch(spanned_, static_cast<std::size_t>(span) * sizeof(float), stream);
    o.probs_out = spanned_.as<float>();
    o.out_stride = span;
    o.spanned_out = true;
  }
  o.w = window(cur_);
  o.regions = R;
  o.window_rows = window_rows_;
  o.fresh_w = fresh_w_;
  o.sink_pos = sink_pos_.as<std::int64_t>();
  o.n_rows = static_cast<int>(step.rows);
  o.limit = static_cast<int>(step.limit);
  o.qpos = step.qpos;
  o.threshold = step.threshold;
  o.decay = step.decay;
  o.victims = victims_.as<int>() + static_cast<std::size_t>(ring_next_) * H;
  // Rows a thread takes per chunk, from the budget (stable across a replayed step's re-arms, so its
  // node keeps one kernel): the fewest that take a part in one chunk (batch 1 x 32k: 512 rows a
  // part, 2 a thread), 4 where parts are longer (16 x 32k: ~2,700 rows a part). 4 a thread at 512
  // rows left half of the CTA idle, each thread's rows in series (25 % slower, stop 44).
  const long long per_part = (static_cast<long long>(step.limit) + static_cast<long long>(parts) - 1) /
                             static_cast<long long>(std::max<std::size_t>(parts, 1));
  const int rows_a_thread = observe_rows_a_thread(per_part);
  const auto kernel = rows_a_thread == 1   ? observe_packed_kernel<1>
                      : rows_a_thread == 2 ? observe_packed_kernel<2>
                                           : observe_packed_kernel<4>;
  if (order_after) launch_slot_order(stream);  // the slots of the rows the attention spanned, before the eviction
  launch_kernel(span > 0, observe_launches_early(), kernel, dim3(static_cast<unsigned>(H), static_cast<unsigned>(parts)),
                dim3(kObserveThreads), 0, stream, o, static_cast<Candidate*>(part_best), arrivals);
  if (order_after) {
    launch_kernel(span > 0, false, order_probs_kernel, dim3(static_cast<unsigned>((span + 255) / 256), 1), dim3(256), 0, stream,
                  slot_of_.as<int>(), spanned_.as<float>(), step.probs_out, static_cast<long long>(H), 1,
                  static_cast<int>(step.out_stride), span);
  }
  if (!evicts) return;
  // The host's block lists learn the victims (one int a head) when they are next needed
  // (apply_victims): a step does not wait for them.
  pending_.push_back(PendingStep{ring_next_, R});
  ring_next_ = (ring_next_ + 1) % kVictimRing;
}

void DevicePackedRows::apply_victims() const {
  if (pending_.empty()) return;
  const std::size_t H = heads_total_;
  if (victims_host_ == nullptr) {
    KVSLIM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&victims_host_),
                                    kVictimRing * std::max<std::size_t>(H, 1) * sizeof(int), cudaHostAllocDefault));
  }
  // The whole ring (at most 64 x H ints), once the steps that wrote it are done.
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(victims_host_, victims_.get(), kVictimRing * H * sizeof(int), cudaMemcpyDeviceToHost,
                                    stream_));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::vector<PendingStep> steps = std::move(pending_);
  pending_.clear();
  for (const PendingStep& step : steps) apply_step_victims(victims_host_ + static_cast<std::size_t>(step.slot) * H, step.regions);
}

void DevicePackedRows::apply_step_victims(const int* victims, int regions) const {
  const int R = regions, G = group_rows_;
  for (std::size_t head = 0; head < heads_total_; ++head) {
    const int v = victims[head];
    if (v < 0) throw std::logic_error("DevicePackedRows: a decode step over the limit found no evictable row");
    Head& h = heads_[head];
    if (v < layout_.sets * R * G) {
      const int set = v / (R * G), local = v % (R * G), offset = local % G;
      const auto b = std::find_if(h.blocks.begin(), h.blocks.end(), [&](const Block& x) { return x.region == local / G; });
      if (b == h.blocks.end() || offset >= b->rows_in(set)) throw std::logic_error("DevicePackedRows: a victim outside the groups held");
      if (!b->salient.empty()) {  // the offset-th row of its set, in token order, leaves the bits
        int seen = 0;
        for (std::size_t t = 0; t < b->salient.size(); ++t) {
          if ((b->salient[t] != 0 ? 0 : 1) == set && seen++ == offset) {
            b->salient.erase(b->salient.begin() + static_cast<std::ptrdiff_t>(t));
            break;
          }
        }
      }
      --b->tokens;
      --h.packed;
      if (b->tokens == 0) {  // its region is all padding now (the device's count is 0 too)
        h.made -= static_cast<std::size_t>(b->made);
        h.blocks.erase(b);
      }
    } else {
      const auto w = std::find(h.window.begin(), h.window.end(), v - layout_.sets * R * G);
      if (w == h.window.end()) throw std::logic_error("DevicePackedRows: a victim outside the window rows held");
      h.window.erase(w);
    }
  }
}

bool DevicePackedRows::settle_acts(int more_rows, std::size_t taken) const {
  if (flush_) return true;
  // Each step whose victims are not read yet took one row of each head, from its window or one of
  // its groups: the lists, which may still hold those rows, count a window too long and, taking
  // every such victim from the groups, too few packed rows -- both only err towards acting.
  for (const Head& h : heads_) {
    if (static_cast<int>(h.window.size()) + more_rows >= staging_) return true;
    if (h.blocks.size() >= 4 && 4 * (h.packed - std::min(taken, h.packed)) < h.made) return true;
  }
  return false;
}

bool DevicePackedRows::settle_would_act() const { return settle_acts(0, pending_.size()); }

bool DevicePackedRows::settle_may_act_after_step() const {
  // The next step adds a row to every window and takes a victim.
  if (!settle_acts(1, pending_.size() + 1)) return false;
  if (pending_.empty()) return true;
  apply_victims();  // unsure: the lists as they are (a wait, at most once a window's worth of steps)
  return settle_acts(1, 1);
}

void DevicePackedRows::between_replays(std::size_t rows, bool settle_now, cudaStream_t stream) {
  stream_ = stream;
  if (settle_now && settle_would_act()) settle(rows, {});
  reserve_next_step();
}

long long DevicePackedRows::attention_rows_capacity(std::size_t) const {
  return static_cast<long long>(layout_.sets) * region_capacity_ * group_rows_ + window_capacity_;
}

void DevicePackedRows::reserve_next_step() {
  if (static_cast<int>(pending_.size()) == kVictimRing) apply_victims();  // (a captured step cannot wait)
  ensure_window(window_rows_ + 1);
  if (victims_.bytes() < kVictimRing * heads_total_ * sizeof(int)) victims_.reserve(kVictimRing * heads_total_ * sizeof(int));
  if (layout_.sets == 2) {
    // A step over two sets orders its probabilities through the slot order (order_probs_kernel):
    // its scratch at the most rows the step can span, so a captured or re-armed step finds it.
    const std::size_t span = static_cast<std::size_t>(attention_rows_capacity());
    reserve_span_scratch(slot_of_, span * sizeof(int), stream_);
    reserve_span_scratch(spanned_, span * sizeof(float), stream_);
  }
}

void DevicePackedRows::reserve_span_scratch(DeviceBuffer& scratch, std::size_t head_bytes, cudaStream_t stream) const {
  const std::size_t bytes = heads_total_ * head_bytes;
  if (scratch.bytes() >= bytes) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVSLIM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    // (capturing_ covers the append only: the stream says whether this launch is captured.)
    throw InputError(std::string(kind()) + " storage (cuda): a captured step would allocate " + std::to_string(bytes) +
                     " bytes of span scratch (decode one step eagerly first)");
  }
  scratch.reserve(bytes);
}

void DevicePackedRows::release_span_scratch() {
  // After a prompt or a question the scratch spans that call's rows (every prompt row of every
  // head: 17 MB a layer at 16 x 32k); decode steps span the store's capacity at most.
  const std::size_t keep = heads_total_ * static_cast<std::size_t>(attention_rows_capacity()) * sizeof(int);
  if (slot_of_.bytes() > 2 * keep) slot_of_.release();
  if (spanned_.bytes() > 2 * keep) spanned_.release();
}

void DevicePackedRows::download_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t seen) const {
  apply_victims();
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::size_t H = heads_total_, G = static_cast<std::size_t>(group_rows_);
  const std::size_t region_rows = H * static_cast<std::size_t>(region_capacity_) * G;
  const std::size_t window_rows = H * static_cast<std::size_t>(window_capacity_);
  std::vector<std::int64_t> pos[2], wpos(window_rows);
  std::vector<float> score[2], expo[2], wscore(window_rows), wexpo(with_exposure_ ? window_rows : 0);
  for (int set = 0; set < layout_.sets; ++set) {
    pos[set].resize(region_rows);
    score[set].resize(region_rows);
    expo[set].resize(with_exposure_ ? region_rows : 0);
  }
  const auto get = [](auto& host, const DeviceBuffer& dev) {
    if (!host.empty()) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(host.data(), dev.get(), host.size() * sizeof(host[0]), cudaMemcpyDeviceToHost));
    }
  };
  for (int set = 0; set < layout_.sets; ++set) {
    get(pos[set], set_[set].pos);
    get(score[set], set_[set].score);
    get(expo[set], set_[set].expo);
  }
  get(wpos, wpos_[cur_]);
  get(wscore, wscore_[cur_]);
  get(wexpo, wexpo_[cur_]);
  for (std::size_t head = 0; head < H; ++head) {
    std::size_t i = 0;
    const auto take = [&](std::int64_t p, float s, float e) {
      const std::size_t at = head * m.stride + i;
      m.positions[at] = p;
      if (i < seen) {
        m.scores[at] = s;
        if (m.exposure != nullptr) m.exposure[at] = e;
      }
      ++i;
    };
    for (const Block& b : heads_[head].blocks) {
      const std::size_t row0 = (head * static_cast<std::size_t>(region_capacity_) + static_cast<std::size_t>(b.region)) * G;
      for_each_row(b, [&](int set, int r) {
        take(pos[set][row0 + r], score[set][row0 + r], with_exposure_ ? expo[set][row0 + r] : 0.f);
      });
    }
    for (const int w : heads_[head].window) {
      const std::size_t at = head * static_cast<std::size_t>(window_capacity_) + static_cast<std::size_t>(w);
      take(wpos[at], wscore[at], with_exposure_ ? wexpo[at] : 0.f);
    }
    if (i != rows) throw std::logic_error("DevicePackedRows: the core and the store disagree on the rows held");
  }
}

void DevicePackedRows::upload_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t n_sink) {
  apply_victims();
  const std::size_t H = heads_total_, G = static_cast<std::size_t>(group_rows_);
  if (H == 0) return;
  const std::size_t region_rows = H * static_cast<std::size_t>(region_capacity_) * G;
  const std::size_t window_rows = H * static_cast<std::size_t>(window_capacity_);
  std::vector<float> score[2], expo[2], wscore(window_rows, 0.f), wexpo(with_exposure_ ? window_rows : 0, 0.f);
  for (int set = 0; set < layout_.sets; ++set) {
    score[set].assign(region_rows, 0.f);
    expo[set].assign(with_exposure_ ? region_rows : 0, 0.f);
  }
  std::vector<std::int64_t> sinks(H, std::numeric_limits<std::int64_t>::min());
  for (std::size_t head = 0; head < H; ++head) {
    if (n_sink > 0 && rows >= n_sink) sinks[head] = m.positions[head * m.stride + n_sink - 1];
    std::size_t i = 0;
    const auto put = [&](float* s, float* e, std::size_t at) {
      s[at] = m.scores[head * m.stride + i];
      if (e != nullptr) e[at] = m.exposure[head * m.stride + i];
      ++i;
    };
    for (const Block& b : heads_[head].blocks) {
      const std::size_t row0 = (head * static_cast<std::size_t>(region_capacity_) + static_cast<std::size_t>(b.region)) * G;
      for_each_row(b, [&](int set, int r) { put(score[set].data(), with_exposure_ ? expo[set].data() : nullptr, row0 + r); });
    }
    for (const int w : heads_[head].window) {
      put(wscore.data(), with_exposure_ ? wexpo.data() : nullptr,
          head * static_cast<std::size_t>(window_capacity_) + static_cast<std::size_t>(w));
    }
    if (i != rows) throw std::logic_error("DevicePackedRows: the core and the store disagree on the rows held");
  }
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const auto put_all = [](DeviceBuffer& dev, const auto& host) {
    if (!host.empty()) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(dev.get(), host.data(), host.size() * sizeof(host[0]), cudaMemcpyHostToDevice));
    }
  };
  for (int set = 0; set < layout_.sets; ++set) {
    put_all(set_[set].score, score[set]);
    put_all(set_[set].expo, expo[set]);
  }
  put_all(wscore_[cur_], wscore);
  put_all(wexpo_[cur_], wexpo);
  if (sink_pos_.bytes() < H * sizeof(std::int64_t)) sink_pos_.reserve(H * sizeof(std::int64_t));
  put_all(sink_pos_, sinks);
  sinks_known_ = n_sink == 0 || rows >= n_sink;
}

bool DevicePackedRows::drop_lowest_on_device(std::size_t rows, std::size_t drop, std::int64_t threshold, std::size_t n_sink,
                                             std::size_t fresh_from) {
  const std::size_t H = heads_total_;
  if (drop == 0 || drop > rows || capturing_ || H == 0 || sink_pos_.bytes() < H * sizeof(std::int64_t)) return false;
  if (n_sink > 0 && !sinks_known_) return false;  // the last upload saw fewer rows than the sinks
  apply_victims();
  flush();  // rows masked by the host first
  // Only while every row waits in the window (slot order = window order: the sinks are the rows
  // at or below sink_pos, as in the decode step's observation).
  for (const Head& h : heads_) {
    if (h.packed > 0 || h.window.size() != rows) return false;
  }
  const int W = window_rows_;
  // The rows appended since the last observation are the window's last rows (appends land at its
  // end, and no step masks a row it has not observed). fresh_w_ marks the last append's first row
  // even after it was observed, so it is not the mark here.
  const int fresh = W - static_cast<int>(rows - std::min(fresh_from, rows));
  DeviceBuffer row_keys, kth, unkeyed, gone;
  row_keys.reserve(H * static_cast<std::size_t>(W) * sizeof(std::uint64_t), stream_);
  kth.reserve(H * sizeof(std::uint64_t), stream_);
  unkeyed.reserve(sizeof(int), stream_);  // zero-filled on stream_
  gone.reserve(H * static_cast<std::size_t>(W), stream_);
  const dim3 grid(static_cast<unsigned>((W + 255) / 256), static_cast<unsigned>(H));
  launch_kernel(true, false, window_keys_kernel, grid, dim3(256), 0, stream_, window(cur_), W,
                sink_pos_.as<std::int64_t>(), fresh, threshold, row_keys.as<std::uint64_t>(), unkeyed.as<int>());
  if (!choose_lowest(row_keys.as<std::uint64_t>(), W, H, drop, unkeyed.as<int>(), kth.as<std::uint64_t>(), stream_)) {
    return false;
  }
  launch_kernel(true, false, mask_window_victims_kernel, grid, dim3(256), 0, stream_, row_keys.as<std::uint64_t>(),
                kth.as<std::uint64_t>(), window(cur_), W, gone.as<std::uint8_t>());
  std::vector<std::uint8_t> gone_host(H * static_cast<std::size_t>(W));
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(gone_host.data(), gone.get(), gone_host.size(), cudaMemcpyDeviceToHost, stream_));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (std::size_t head = 0; head < H; ++head) {
    std::vector<int>& w = heads_[head].window;
    std::erase_if(w, [&](int i) { return gone_host[head * static_cast<std::size_t>(W) + static_cast<std::size_t>(i)] != 0; });
    if (w.size() != rows - drop) throw std::logic_error("DevicePackedRows: the device's trim left the wrong number of rows");
  }
  return true;
}

bool DevicePackedRows::prompt_rows(std::size_t rows, std::int64_t sink_position, PromptRows& out) {
  const std::size_t H = heads_total_;
  if (capturing_ || H == 0 || rows > static_cast<std::size_t>(window_rows_)) return false;
  apply_victims();
  flush();
  for (const Head& h : heads_) {
    if (h.packed > 0 || h.window.size() != rows) return false;
    for (std::size_t i = 0; i < rows; ++i) {
      if (h.window[i] != static_cast<int>(i)) return false;
    }
  }
  const std::vector<std::int64_t> sinks(H, sink_position);
  if (sink_pos_.bytes() < H * sizeof(std::int64_t)) sink_pos_.reserve(H * sizeof(std::int64_t), stream_);
  upload(sink_pos_, sinks, stream_);
  sinks_known_ = true;
  const WindowRows w = window(cur_);
  out = PromptRows{w.score, w.expo, w.pos, static_cast<long long>(window_capacity_)};
  return true;
}

std::vector<DevicePackedRows::BlockCodes> DevicePackedRows::block_codes(std::size_t bh) const {
  apply_victims();
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::size_t G = static_cast<std::size_t>(group_rows_), D = dim_, cap = static_cast<std::size_t>(region_capacity_);
  const auto get = [](auto& host, const void* dev) {
    if (!host.empty()) KVSLIM_CUDA_CHECK(cudaMemcpy(host.data(), dev, host.size() * sizeof(host[0]), cudaMemcpyDeviceToHost));
  };
  std::vector<BlockCodes> out;
  for (const Block& b : heads_[bh].blocks) {
    BlockCodes c;
    const std::size_t region = bh * cap + static_cast<std::size_t>(b.region);
    for (int set = 0; set < layout_.sets; ++set) {
      const SetStore& st = set_[set];
      const std::size_t n = static_cast<std::size_t>(b.rows_in(set)), krb = static_cast<std::size_t>(st.k_rb);
      std::vector<std::uint8_t>& k_codes = set == 0 ? c.k_codes : c.lo_k_codes;
      std::vector<std::uint8_t>& v_codes = set == 0 ? c.v_codes : c.lo_v_codes;
      std::vector<std::uint16_t>& k_params = set == 0 ? c.k_params : c.lo_k_params;
      k_codes.resize(n * krb);
      v_codes.resize(n * static_cast<std::size_t>(v_rb_));
      k_params.resize(2 * D);
      get(k_codes, st.k_codes.as<std::uint8_t>() + region * G * krb);
      get(v_codes, st.v_codes.as<std::uint8_t>() + region * G * static_cast<std::size_t>(v_rb_));
      get(k_params, st.k_params.as<std::uint16_t>() + region * 2 * D);
      if (set == 0) {
        c.v_params.resize(2 * D);
        get(c.v_params, st.v_params.as<std::uint16_t>() + region * 2 * D);
      }
    }
    c.salient = b.salient;
    out.push_back(std::move(c));
  }
  return out;
}

void DevicePackedRows::download_head(std::size_t bh, std::size_t rows, std::uint16_t* keys, std::uint16_t* values) const {
  const std::size_t D = dim_;
  const auto& k = quant::simd_kernels();
  std::vector<float> scale(D), zero(D);
  std::vector<std::uint16_t*> out_rows[2][2];  // [set][keys, values]: each set's rows in token order
  std::size_t row = 0;
  const std::vector<Block>& blocks = heads_[bh].blocks;  // (block_codes read the victims first)
  const std::vector<BlockCodes> codes = block_codes(bh);
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const BlockCodes& c = codes[i];
    for (auto& set : out_rows) {
      for (auto& v : set) v.clear();
    }
    int t = 0;
    for_each_row(blocks[i], [&](int set, int) {
      out_rows[set][0].push_back(keys + (row + static_cast<std::size_t>(t)) * D);
      out_rows[set][1].push_back(values + (row + static_cast<std::size_t>(t)) * D);
      ++t;
    });
    for (int set = 0; set < layout_.sets; ++set) {
      for (int which = 0; which < 2; ++which) {
        const std::size_t n = out_rows[set][which].size();
        if (n == 0) continue;
        const std::uint16_t* p = (which ? c.v_params : set == 0 ? c.k_params : c.lo_k_params).data();
        const std::vector<std::uint8_t>& bytes = which ? (set == 0 ? c.v_codes : c.lo_v_codes) : (set == 0 ? c.k_codes : c.lo_k_codes);
        k.params_to_f32(p, p + D, D, scale.data(), zero.data());
        k.decode_rows_f16(bytes.data(), n, D, scale.data(), zero.data(), which ? value_bits_ : layout_.key_bits[set],
                          out_rows[set][which].data());
      }
    }
    row += static_cast<std::size_t>(t);
  }
  const std::vector<int>& w = heads_[bh].window;
  if (row + w.size() != rows) throw std::logic_error("DevicePackedRows: download of a row count it does not hold");
  if (w.empty()) return;
  std::vector<std::uint16_t> wk(static_cast<std::size_t>(window_rows_) * D), wv(wk.size());
  const std::size_t at = bh * static_cast<std::size_t>(window_capacity_) * D;
  KVSLIM_CUDA_CHECK(cudaMemcpy(wk.data(), wk_[cur_].as<std::uint16_t>() + at, wk.size() * 2, cudaMemcpyDeviceToHost));
  KVSLIM_CUDA_CHECK(cudaMemcpy(wv.data(), wv_[cur_].as<std::uint16_t>() + at, wv.size() * 2, cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < w.size(); ++i) {
    std::copy_n(wk.data() + static_cast<std::size_t>(w[i]) * D, D, keys + (row + i) * D);
    std::copy_n(wv.data() + static_cast<std::size_t>(w[i]) * D, D, values + (row + i) * D);
  }
}

void DevicePackedRows::head_positions(std::size_t bh, std::size_t rows, std::int64_t* out) const {
  apply_victims();
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::size_t G = static_cast<std::size_t>(group_rows_), cap = static_cast<std::size_t>(region_capacity_);
  std::size_t row = 0;
  std::vector<std::int64_t> region[2];
  for (const Block& b : heads_[bh].blocks) {
    for (int set = 0; set < layout_.sets; ++set) {
      region[set].resize(static_cast<std::size_t>(b.rows_in(set)));
      if (!region[set].empty()) {
        KVSLIM_CUDA_CHECK(cudaMemcpy(region[set].data(),
                                     set_[set].pos.as<std::int64_t>() + (bh * cap + static_cast<std::size_t>(b.region)) * G,
                                     region[set].size() * 8, cudaMemcpyDeviceToHost));
      }
    }
    for_each_row(b, [&](int set, int r) { out[row++] = region[set][static_cast<std::size_t>(r)]; });
  }
  const std::vector<int>& w = heads_[bh].window;
  if (row + w.size() != rows) throw std::logic_error("DevicePackedRows: positions of a row count it does not hold");
  if (w.empty()) return;
  std::vector<std::int64_t> wp(static_cast<std::size_t>(window_rows_));
  KVSLIM_CUDA_CHECK(cudaMemcpy(wp.data(), wpos_[cur_].as<std::int64_t>() + bh * static_cast<std::size_t>(window_capacity_),
                               wp.size() * 8, cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < w.size(); ++i) out[row + i] = wp[static_cast<std::size_t>(w[i])];
}

void DevicePackedRows::key_logits(std::size_t, std::size_t, const float*, float*) const {
  not_on_device("the key proxy reads stored keys on the host; device eviction is scored by attention");
}

void DevicePackedRows::feed(attend::HeadAttention&, std::size_t, const std::int64_t*, std::size_t) const {
  not_on_device("the device kernels attend over the codes (DeviceEvictionCache::attend)");
}

CacheView DevicePackedRows::view(std::size_t, std::size_t, std::size_t, const std::int64_t*, std::size_t) const {
  not_on_device("DeviceEvictionCache::materialize downloads and decodes the rows");
}

std::size_t DevicePackedRows::resident_bytes() const {
  std::size_t bytes = slot_of_.bytes();
  for (const SetStore& st : set_) {
    for (const DeviceBuffer* b : {&st.k_codes, &st.v_codes, &st.k_params, &st.v_params, &st.pos, &st.score, &st.expo, &st.tokens}) {
      bytes += b->bytes();
    }
  }
  for (int i = 0; i < 2; ++i) bytes += wk_[i].bytes() + wv_[i].bytes() + wpos_[i].bytes() + wscore_[i].bytes() + wexpo_[i].bytes();
  return bytes;
}

std::size_t DevicePackedRows::host_bytes() const {
  std::size_t bytes = heads_.capacity() * sizeof(Head);
  for (const Head& h : heads_) {
    bytes += h.blocks.capacity() * sizeof(Block) + h.window.capacity() * sizeof(int);
    for (const Block& b : h.blocks) bytes += b.salient.capacity();
  }
  return bytes;
}

void DevicePackedRows::reset() {
  pending_.clear();  // the ring's victims belong to rows that go now
  ring_next_ = 0;
  if (victims_host_ != nullptr) cudaFreeHost(victims_host_);  // sized by this shape's heads
  victims_host_ = nullptr;
  for (SetStore& st : set_) {
    for (DeviceBuffer* b : {&st.k_codes, &st.v_codes, &st.k_params, &st.v_params, &st.pos, &st.score, &st.expo, &st.tokens}) {
      b->release();
    }
  }
  for (DeviceBuffer* b : {&list_dev_, &jobs_dev_, &masked_dev_, &repack_rows_dev_, &scratch_k_, &scratch_v_, &scratch_pos_,
                          &scratch_score_, &scratch_expo_, &slot_of_, &spanned_, &window_map_, &sink_pos_, &victims_,
                          &select_jobs_dev_, &salient_dev_, &set_list_dev_, &repack_out_dev_}) {
    b->release();
  }
  release_window(0);
  release_window(1);
  heads_.clear();
  heads_total_ = dim_ = 0;
  region_capacity_ = window_capacity_ = window_rows_ = cur_ = fresh_w_ = 0;
  sinks_known_ = false;
  masked_.clear();
  for (int set = 0; set < 2; ++set) {
    closes_[set].clear();
    close_list_[set].clear();
  }
  flush_ = false;
}

void DevicePackedRows::add_figures(CacheStats& stats) const {
  apply_victims();
  std::size_t rows = 0, waiting = 0;
  for (const Head& h : heads_) {
    rows += h.packed + h.window.size();
    waiting += h.window.size();
  }
  const double elements = 2.0 * static_cast<double>(rows) * static_cast<double>(dim_);
  stats.figures.emplace_back("storage_bits_per_element", elements == 0 ? 0.0 : 8.0 * static_cast<double>(resident_bytes()) / elements);
  stats.figures.emplace_back("storage_staged_rows", heads_.empty() ? 0.0 : static_cast<double>(waiting) / static_cast<double>(heads_.size()));
  stats.figures.emplace_back("hi_bits", layout_.key_bits[0]);
  stats.figures.emplace_back("lo_bits", layout_.key_bits[layout_.sets - 1]);
  stats.figures.emplace_back("value_bits", value_bits_);
}

}  // namespace kvslim::cuda
