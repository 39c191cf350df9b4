#include "cuda/device_eviction_cache.h"

#include "cache/cross_layer_importance.h"
#include "cache/observation_check.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cuda/append.h"
#include "cuda/device_packed_rows.h"
#include "cuda/attend.h"
#include "cuda/kernel_launch.h"
#include "cuda/lowest_candidate.cuh"
#include "cuda/row_probability.cuh"
#include "cuda/select_lowest.h"
#include "cuda/step_graph.h"
#include "kvslim/errors.h"

namespace kvslim::cuda {
namespace {

// Milliseconds since the last lap (host wall time).
class HostClock {
 public:
  double lap() {
    const auto now = std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
    return ms;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

std::size_t round_up16(std::size_t x) { return (x + 15) / 16 * 16; }

// Pinned host memory for observations up to this size stays for the next one.
constexpr std::size_t kKeptProbsBytes = std::size_t{4} << 20;

// A row's key, value and position from slot row `src` to `dst` (rows of every head counted
// together), by one CTA. Rows are D fp16/bf16 values (D = 64 or 128: 128 or 256 bytes, 16-byte
// aligned).
__device__ void move_row(std::uint16_t* k, std::uint16_t* v, std::int64_t* pos, long long src, long long dst, int D) {
  const uint4* ks = reinterpret_cast<const uint4*>(k + src * D);
  const uint4* vs = reinterpret_cast<const uint4*>(v + src * D);
  uint4* kd = reinterpret_cast<uint4*>(k + dst * D);
  uint4* vd = reinterpret_cast<uint4*>(v + dst * D);
  for (int i = threadIdx.x; i < D / 8; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
  if (threadIdx.x == 0) pos[dst] = pos[src];
}

// One CTA per move (head, from, to), the moves copied from the host.
__global__ void apply_moves_kernel(const int* moves, std::uint16_t* k, std::uint16_t* v, std::int64_t* pos,
                                   long long stride, int D) {
  const int* m = moves + 3 * blockIdx.x;
  move_row(k, v, pos, m[0] * stride + m[1], m[0] * stride + m[2], D);
}

// One CTA per head, every head the same move (from, to): streaming's decode step, whose heads all
// evict the same slot. Arguments only, so a replayed step updates its node instead of copying.
__global__ void apply_uniform_move_kernel(int from, int to, std::uint16_t* k, std::uint16_t* v, std::int64_t* pos,
                                          long long stride, int D) {
  move_row(k, v, pos, blockIdx.x * stride + from, blockIdx.x * stride + to, D);
}
// (The scores and exposure mirrors are the core's to write back after a host decision: moves
// happen only there, push_metadata follows them.)

// A squeeze budget's trim on the device (DeviceSlots::drop_lowest_on_device). Each row's selection
// key [heads, n] (select_lowest.h): candidates are slot >= n_sink with a position below the
// threshold; the rows appended since the last observation (slot >= fresh_from) score 0, as the
// core's fresh rows. A candidate position outside [0, 2^32) sets *unkeyed (the host decides).
__global__ void slot_keys_kernel(const std::int64_t* pos, const float* scores, const float* exposure, long long stride,
                                 int n, int n_sink, int fresh_from, std::int64_t threshold, std::uint64_t* keys,
                                 int* unkeyed) {
  const int head = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const long long at = head * stride + j;
  const std::int64_t p = pos[at];
  std::uint64_t key = kNotCandidate;
  if (j >= n_sink && p < threshold) {
    if (p < 0 || p > 0xFFFFFFFFLL) {
      atomicOr(unkeyed, 1);
    } else {
      const bool fresh = j >= fresh_from;
      const float s = fresh ? 0.f : scores[at];
      float effective = s;
      if (exposure != nullptr) {
        const float e = fresh ? 0.f : exposure[at];
        effective = e > 0.f ? __fdiv_rn(s, e) : 0.f;
      }
      key = selection_key(effective, p);
    }
  }
  keys[static_cast<long long>(head) * n + j] = key;
}

// The core's hole filling as lists, one CTA a head: holes = the victims below `keep` (the rows that
// stay), ascending; movers = the kept rows at or above `keep`, from the last down. Hole r takes
// mover r (there are as many of each). holes, movers [heads, drop]; count [heads].
__global__ void __launch_bounds__(kObserveThreads)
    hole_fill_lists_kernel(const std::uint64_t* keys, const std::uint64_t* kth, int n, int keep, int drop, int* holes,
                           int* movers, int* count) {
  const int head = blockIdx.x;
  const std::uint64_t* k = keys + static_cast<long long>(head) * n;
  const std::uint64_t last = kth[head];
  int* hole = holes + static_cast<long long>(head) * drop;
  int* mover = movers + static_cast<long long>(head) * drop;
  int found = 0;
  for (int c = 0; c < keep; c += kObserveThreads) {
    const int i = c + threadIdx.x;
    const bool victim = i < keep && k[i] <= last;
    int chunk = 0;
    const int before = cta_exclusive_sum(victim ? 1 : 0, &chunk);
    if (victim) hole[found + before] = i;
    found += chunk;
  }
  int moving = 0;
  for (int c = 0; c < n - keep; c += kObserveThreads) {
    const int i = n - 1 - (c + static_cast<int>(threadIdx.x));  // descending
    const bool kept = c + static_cast<int>(threadIdx.x) < n - keep && k[i] > last;
    int chunk = 0;
    const int before = cta_exclusive_sum(kept ? 1 : 0, &chunk);
    if (kept) mover[moving + before] = i;
    moving += chunk;
  }
  if (threadIdx.x == 0) {  // equal when exactly `drop` keys are at or below kth (the host checks)
    count[head] = found;
    count[gridDim.x + head] = moving;
  }
}

// Mover r of each head into hole r: keys, values, position, score, exposure. grid (drop, heads).
__global__ void fill_holes_kernel(const int* holes, const int* movers, const int* count, int drop, std::uint16_t* k,
                                  std::uint16_t* v, std::int64_t* pos, float* scores, float* exposure, long long stride,
                                  int D) {
  const int r = blockIdx.x, head = blockIdx.y;
  if (r >= count[head]) return;
  const long long src = head * stride + movers[static_cast<long long>(head) * drop + r];
  const long long dst = head * stride + holes[static_cast<long long>(head) * drop + r];
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    k[dst * D + c] = k[src * D + c];
    v[dst * D + c] = v[src * D + c];
  }
  if (threadIdx.x == 0) {
    pos[dst] = pos[src];
    scores[dst] = scores[src];
    if (exposure != nullptr) exposure[dst] = exposure[src];
  }
}

// One decode step's observation of every head (one CTA each): the eviction core's observe() for
// one query -- scores = scores * decay + p, exposure = exposure * decay + (pos <= qpos), rows
// appended since the last observation starting from 0 -- then, over the limit, its drop_lowest(1):
// the evictable row (slot >= n_sink, position below the recent window) of the lowest effective
// score (score / exposure when normalised; ties: the lower position) leaves, the head's last row
// moving into its slot. Rounded as the CPU rounds (no contraction), so the same probabilities
// give the same victims.
struct DecodeObservation {
  const float* probs = nullptr;  // [heads, probs_stride]: the query's attention per row
  long long probs_stride = 0;
  // A deferred step's (DeviceCache::DeferredProbs: replayed, or attend_and_observe's): probs are
  // not read but computed from logits and final_ml (non-null logits), and written to probs_out
  // ([heads, probs_stride]) unless it is null (nobody reads them).
  float* probs_out = nullptr;
  const float* logits = nullptr;    // [heads, G, probs_stride]
  const float* final_ml = nullptr;  // [heads, G, 2]
  int G = 0;
  std::uint16_t* k = nullptr;  // [heads, stride, D]
  std::uint16_t* v = nullptr;
  std::int64_t* pos = nullptr;  // [heads, stride]
  float* scores = nullptr;      // [heads, stride]
  float* exposure = nullptr;    // [heads, stride] or null (plain attention scoring)
  long long stride = 0;
  int D = 0, n_rows = 0, fresh_from = 0, n_sink = 0, limit = 0;
  std::int64_t qpos = 0, threshold = 0;
  float decay = 1.f;
};

// One decode step's observation of every head: grid (heads, parts), each CTA scores its part of the
// head's rows (observe()) and finds its lowest candidate; with several parts the last CTA of a head
// to finish (a counter per head, reset by it) takes the lowest of the parts' candidates. Then that
// CTA drops the victim (drop_lowest(1): the last row moves into its slot). Parts keep a step's
// latency at a few rows per thread when the batch has fewer heads than the GPU has SMs.
__global__ void __launch_bounds__(kObserveThreads)
    observe_decode_kernel(DecodeObservation o, Candidate* part_best, unsigned* arrivals) {
  const int head = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const long long base = static_cast<long long>(head) * o.stride;
  const long long probs_base = static_cast<long long>(head) * o.probs_stride;
  const int per = (o.n_rows + parts - 1) / parts, first = part * per, end = min(o.n_rows, first + per);
  Candidate best{0.f, 0, -1};
  for (int i = first + threadIdx.x; i < end; i += blockDim.x) {
    const bool fresh = i >= o.fresh_from;
    float s = fresh ? 0.f : o.scores[base + i];
    if (o.decay != 1.f) s = __fmul_rn(s, o.decay);
    float pi;
    if (o.logits != nullptr) {
      pi = summed_probability(o.logits, o.final_ml, static_cast<long long>(head) * o.G, o.G, o.probs_stride, i);
      if (o.probs_out != nullptr) o.probs_out[probs_base + i] = pi;
    } else {
      pi = o.probs[probs_base + i];
    }
    s = __fadd_rn(s, pi);
    o.scores[base + i] = s;
    const std::int64_t at = o.pos[base + i];
    float effective = s;
    if (o.exposure != nullptr) {
      float e = fresh ? 0.f : o.exposure[base + i];
      if (o.decay != 1.f) e = __fmul_rn(e, o.decay);
      e = __fadd_rn(e, at <= o.qpos ? 1.f : 0.f);
      o.exposure[base + i] = e;
      effective = e > 0.f ? __fdiv_rn(s, e) : 0.f;
    }
    const Candidate c{effective, at, i};
    if (i >= o.n_sink && at < o.threshold && lower(c, best)) best = c;
  }
  if (o.n_rows <= o.limit) return;
  if (!head_lowest(best, part_best, arrivals, head, part, parts)) return;
  const int victim = best.slot, last = o.n_rows - 1;
  // No evictable row cannot happen: validate() keeps the budget above the sinks and the window.
  if (victim < 0 || victim == last) return;
  const uint4* ks = reinterpret_cast<const uint4*>(o.k + (base + last) * o.D);
  const uint4* vs = reinterpret_cast<const uint4*>(o.v + (base + last) * o.D);
  uint4* kd = reinterpret_cast<uint4*>(o.k + (base + victim) * o.D);
  uint4* vd = reinterpret_cast<uint4*>(o.v + (base + victim) * o.D);
  for (int i = threadIdx.x; i < o.D / 8; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
  if (threadIdx.x == 0) {
    // (the last row's metadata may have been written by another part: read past L1)
    o.pos[base + victim] = __ldcg(o.pos + base + last);
    o.scores[base + victim] = __ldcg(o.scores + base + last);
    if (o.exposure != nullptr) o.exposure[base + victim] = __ldcg(o.exposure + base + last);
  }
}

// squeeze's key signal (squeeze/concentration.h's concentration_score) of one head's S incoming
// keys [S, D] (D = 64 or 128), each element rounded to fp16 as the host cache's intake rounds it:
// with u_i = k_i / (|k_i| + 1e-8), out[head] = (|sum_i u_i|^2 - sum_i |u_i|^2) / (S (S - 1)), the
// sums in double. A warp takes a row at a time (lane: channels lane, lane + 32, ...).
constexpr int kDispersionThreads = 256;
__global__ void __launch_bounds__(kDispersionThreads)
    key_dispersion_kernel(const void* keys, DType dtype, int S, int D, double* out) {
  extern __shared__ double sums[];  // [D] direction sums, [1] trace
  for (int j = threadIdx.x; j <= D; j += blockDim.x) sums[j] = 0.0;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int per_lane = D / 32;
  const long long head = static_cast<long long>(blockIdx.x) * S * D;
  double acc[4] = {0.0, 0.0, 0.0, 0.0}, trace = 0.0;
  for (int i = warp; i < S; i += warps) {
    float k[4] = {0.f, 0.f, 0.f, 0.f};
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c >= per_lane) break;
      const long long at = head + static_cast<long long>(i) * D + lane + 32 * c;
      k[c] = __half2float(__float2half_rn(load_input(keys, dtype, at)));
      sq += k[c] * k[c];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const double sqd = sq, inv = 1.0 / (sqrt(sqd) + 1e-8);
    trace += sqd * inv * inv;  // every lane holds the row's sum: lane 0's copy is added below
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] += static_cast<double>(k[c]) * inv;
  }
  for (int c = 0; c < per_lane; ++c) atomicAdd(&sums[lane + 32 * c], acc[c]);
  if (lane == 0) atomicAdd(&sums[D], trace);
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int j = 0; j < D; ++j) total += sums[j] * sums[j];
    out[blockIdx.x] = S < 2 ? 0.0 : (total - sums[D]) / (static_cast<double>(S) * static_cast<double>(S - 1));
  }
}

[[noreturn]] void not_on_device(const char* what) {
  throw std::logic_error(std::string("DeviceSlots: ") + what);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DeviceSlots

void DeviceSlots::begin(std::size_t heads_total, std::size_t dim) {
  heads_total_ = heads_total;
  dim_ = dim;
}

void DeviceSlots::place(const AppendInput& in, std::size_t rows, cudaStream_t stream) {
  launch_dense_append(in, keys(), values(), type_, static_cast<long long>(stride_), static_cast<int>(rows), positions(),
                      stream, /*pos_per_head=*/true);
}

int DeviceSlots::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, std::size_t rows,
                                 bool attention_scoring, int sm_count, cudaStream_t stream) const {
  const int n = static_cast<int>(rows);
  const int splits = dense_splits(q, n, sm_count, type_);
  if (!count_only) {
    DenseRows d;
    d.k = keys();
    d.v = values();
    d.head_stride = static_cast<long long>(stride_ * dim_);
    d.pos = positions();
    d.pos_head_stride = static_cast<long long>(stride_);
    d.n_rows = n;
    d.type = type_;
    // Attention scorings evict after the attend, refilling a slot with the head's newest row: a
    // later call's queries see every moved row. streaming evicts as rows arrive, before its attend.
    d.unordered = !attention_scoring;
    launch_dense(q, d, parts, 0, splits, stream);
  }
  return splits;
}

void DeviceSlots::download_head(std::size_t bh, std::size_t rows, std::uint16_t* keys, std::uint16_t* values) const {
  download_dense_head(this->keys(), this->values(), type_, stride_, dim_, bh, rows, keys, values);
}

void DeviceSlots::download_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t seen) const {
  const std::size_t ds = stride_;
  KVSLIM_CUDA_CHECK(cudaMemcpy2D(m.positions, m.stride * 8, positions(), ds * 8, rows * 8, heads_total_, cudaMemcpyDeviceToHost));
  if (seen > 0) {
    KVSLIM_CUDA_CHECK(cudaMemcpy2D(m.scores, m.stride * 4, scores(), ds * 4, seen * 4, heads_total_, cudaMemcpyDeviceToHost));
    if (m.exposure != nullptr) {
      KVSLIM_CUDA_CHECK(
          cudaMemcpy2D(m.exposure, m.stride * 4, exposure(), ds * 4, seen * 4, heads_total_, cudaMemcpyDeviceToHost));
    }
  }
}

void DeviceSlots::upload_metadata(const EvictionCore::Metadata& m, std::size_t rows, std::size_t) {
  const std::size_t ds = stride_;
  // Synchronous copies from pageable memory: the core may change its arrays right after.
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KVSLIM_CUDA_CHECK(cudaMemcpy2D(scores(), ds * 4, m.scores, m.stride * 4, rows * 4, heads_total_, cudaMemcpyHostToDevice));
  if (m.exposure != nullptr) {
    KVSLIM_CUDA_CHECK(cudaMemcpy2D(exposure(), ds * 4, m.exposure, m.stride * 4, rows * 4, heads_total_, cudaMemcpyHostToDevice));
  }
}

void DeviceSlots::head_positions(std::size_t bh, std::size_t rows, std::int64_t* out) const {
  // From the device: the decode kernel may have moved rows since the core last saw them.
  KVSLIM_CUDA_CHECK(cudaMemcpy(out, positions() + bh * stride_, rows * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
}

void DeviceSlots::relayout(std::size_t capacity, std::size_t keep) {
  if (capturing_) {
    throw InputError("device eviction cache: a captured decode step would reallocate the store (" +
                     std::to_string(stride_) + " slots per head, " + std::to_string(capacity) +
                     " needed): run one eager step at the budget first (the store then keeps room for budget + 1 "
                     "rows), then capture (StepGraph)");
  }
  flush();
  const std::size_t stride = round_up16(std::max<std::size_t>(capacity, 1));
  const std::size_t H = heads_total_, D = dim_;
  DeviceBuffer k, v, pos, scores, exposure;
  k.reserve(H * stride * D * 2);
  v.reserve(H * stride * D * 2);
  pos.reserve(H * stride * sizeof(std::int64_t));
  scores.reserve(H * stride * sizeof(float));
  if (with_exposure_) exposure.reserve(H * stride * sizeof(float));
  copy_head_rows(k.get(), stride, k_.get(), stride_, keep, H, D * 2, stream_);
  copy_head_rows(v.get(), stride, v_.get(), stride_, keep, H, D * 2, stream_);
  copy_head_rows(pos.get(), stride, pos_.get(), stride_, keep, H, sizeof(std::int64_t), stream_);
  copy_head_rows(scores.get(), stride, scores_.get(), stride_, keep, H, sizeof(float), stream_);
  if (with_exposure_) copy_head_rows(exposure.get(), stride, exposure_.get(), stride_, keep, H, sizeof(float), stream_);
  if (keep > 0) KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the old store goes
  k_ = std::move(k);
  v_ = std::move(v);
  pos_ = std::move(pos);
  scores_ = std::move(scores);
  exposure_ = std::move(exposure);
  stride_ = stride;
  read_in_.assign(H * stride, 0u);
  written_in_.assign(H * stride, 0u);
}

void DeviceSlots::write(std::size_t, std::size_t, const std::uint16_t*, const std::uint16_t*) {
  not_on_device("rows reach the device slots through the append kernel, never one by one from the host");
}

void DeviceSlots::move(std::size_t head, std::size_t from, std::size_t to) {
  const std::size_t f = head * stride_ + from, t = head * stride_ + to;
  if (written_in_[f] == epoch_ || written_in_[t] == epoch_ || read_in_[t] == epoch_) flush();
  moves_.insert(moves_.end(), {static_cast<int>(head), static_cast<int>(from), static_cast<int>(to)});
  read_in_[f] = epoch_;
  written_in_[t] = epoch_;
}

bool DeviceSlots::uniform_moves() const {
  if (moves_.size() != 3 * heads_total_) return false;
  for (std::size_t h = 0; h < heads_total_; ++h) {
    const int* m = moves_.data() + 3 * h;
    if (m[0] != static_cast<int>(h) || m[1] != moves_[1] || m[2] != moves_[2]) return false;
  }
  return true;
}

void DeviceSlots::flush() {
  if (moves_.empty()) return;
  if (uniform_moves()) {
    launch_kernel(true, false, apply_uniform_move_kernel, dim3(static_cast<unsigned>(heads_total_)), dim3(32), 0, stream_,
                  moves_[1], moves_[2], keys(), values(), positions(), static_cast<long long>(stride_),
                  static_cast<int>(dim_));
    moves_.clear();
    next_epoch();
    return;
  }
  if (LaunchScope::active() != nullptr) {
    throw InputError("device eviction cache: a replayed decode step moved different slots in different heads (a "
                     "list copied from the host, which a graph cannot replay); decode this cache eagerly");
  }
  moves_dev_.upload(moves_.data(), moves_.size() * sizeof(int), stream_);  // moves_ may be reused at once
  const unsigned n = static_cast<unsigned>(moves_.size() / 3);
  launch_kernel(true, false, apply_moves_kernel, dim3(n), dim3(32), 0, stream_, moves_dev_.as<int>(), keys(), values(),
                positions(), static_cast<long long>(stride_), static_cast<int>(dim_));
  moves_.clear();
  next_epoch();
}

void DeviceSlots::next_epoch() {
  if (++epoch_ == 0) {  // wrapped: no slot may look marked in the new epoch
    std::fill(read_in_.begin(), read_in_.end(), 0u);
    std::fill(written_in_.begin(), written_in_.end(), 0u);
    epoch_ = 1;
  }
}

bool DeviceSlots::drop_lowest_on_device(std::size_t rows, std::size_t drop, std::int64_t threshold, std::size_t n_sink,
                                        std::size_t fresh_from) {
  if (drop == 0 || drop > rows || rows > static_cast<std::size_t>(std::numeric_limits<int>::max()) || capturing_) {
    return false;
  }
  flush();  // the core's recorded moves first
  const std::size_t H = heads_total_, n = rows;
  // Scratch for this call only (a prompt's rows: 8 bytes a row of every head).
  DeviceBuffer row_keys, kth, lists, count, unkeyed;
  row_keys.reserve(H * n * sizeof(std::uint64_t), stream_);
  kth.reserve(H * sizeof(std::uint64_t), stream_);
  lists.reserve(2 * H * drop * sizeof(int), stream_);
  count.reserve(2 * H * sizeof(int), stream_);  // per head: holes filled, then rows moved (checked below)
  unkeyed.reserve(sizeof(int), stream_);  // zero-filled on stream_
  launch_kernel(true, false, slot_keys_kernel, dim3(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(H)),
                dim3(256), 0, stream_, positions(), scores(), exposure(), static_cast<long long>(stride_),
                static_cast<int>(n), static_cast<int>(n_sink), static_cast<int>(std::min(fresh_from, n)), threshold,
                row_keys.as<std::uint64_t>(), unkeyed.as<int>());
  // A position without a key, or fewer candidates than must go (the host core names that error).
  if (!choose_lowest(row_keys.as<std::uint64_t>(), static_cast<long long>(n), H, drop, unkeyed.as<int>(),
                     kth.as<std::uint64_t>(), stream_)) {
    return false;
  }
  const int keep = static_cast<int>(n - drop);
  int* holes = lists.as<int>();
  int* movers = holes + H * drop;
  launch_kernel(true, false, hole_fill_lists_kernel, dim3(static_cast<unsigned>(H)), dim3(kObserveThreads), 0, stream_,
                row_keys.as<std::uint64_t>(), kth.as<std::uint64_t>(), static_cast<int>(n), keep, static_cast<int>(drop), holes,
                movers, count.as<int>());
  // Holes and movers pair up only if the selection took exactly `drop` rows a head (two rows of a
  // head with one key -- a repeated position -- would break that): checked before any row moves,
  // so a mismatch leaves the store as it was and the host decides.
  std::vector<int> counts(2 * H);
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(counts.data(), count.get(), counts.size() * sizeof(int), cudaMemcpyDeviceToHost, stream_));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (std::size_t head = 0; head < H; ++head) {
    if (counts[head] != counts[H + head]) return false;
  }
  launch_kernel(true, false, fill_holes_kernel, dim3(static_cast<unsigned>(drop), static_cast<unsigned>(H)),
                dim3(static_cast<unsigned>(dim_)), 0, stream_, holes, movers, count.as<int>(), static_cast<int>(drop),
                keys(), values(), positions(), scores(), exposure(), static_cast<long long>(stride_),
                static_cast<int>(dim_));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the scratch goes
  return true;
}

void DeviceSlots::erase(std::size_t, std::span<const std::size_t>) {
  not_on_device("slots are moved, not erased (slot_writes() is true)");
}

void DeviceSlots::key_logits(std::size_t, std::size_t, const float*, float*) const {
  not_on_device("the key proxy reads stored keys on the host; device eviction is scored by attention");
}

void DeviceSlots::feed(attend::HeadAttention&, std::size_t, const std::int64_t*, std::size_t) const {
  not_on_device("the device kernels attend over the slots (DeviceEvictionCache::attend)");
}

CacheView DeviceSlots::view(std::size_t, std::size_t, std::size_t, const std::int64_t*, std::size_t) const {
  not_on_device("DeviceEvictionCache::materialize downloads the slots");
}

void DeviceSlots::reset() {
  k_.release();
  v_.release();
  pos_.release();
  scores_.release();
  exposure_.release();
  moves_dev_.release();
  moves_.clear();
  read_in_ = std::vector<std::uint32_t>();
  written_in_ = std::vector<std::uint32_t>();
  epoch_ = 1;
  heads_total_ = dim_ = stride_ = 0;
  type_ = DenseType::f16;
}

// ---------------------------------------------------------------------------------------------
// DeviceEvictionCache

DeviceEvictionCache::DeviceEvictionCache(std::string method, EvictionPolicy policy, std::size_t budget, int device,
                                         std::unique_ptr<SqueezeSchedule> squeeze, std::unique_ptr<DeviceRowStore> store)
    : DeviceCache(std::move(method), device),
      store_(store ? store.release() : new DeviceSlots(policy.scoring == Scoring::attention_normalized)),
      slots_(dynamic_cast<DeviceSlots*>(store_)),
      core_(policy, std::unique_ptr<RowStorage>(store_)),
      budget_(budget),
      squeeze_(std::move(squeeze)) {
  mirror_positions_ = false;
}

ObservationNeeds DeviceEvictionCache::needs() const {
  ObservationNeeds n = eviction_needs(core_);
  if (squeeze_) squeeze_->add_needs(n, core_.policy().obs_window);
  return n;
}

void DeviceEvictionCache::hold_while_uncertain() {
  // As the host cache (EvictionCache::hold_while_uncertain): while squeeze's deferred schedule
  // keeps more than the budget, a compressed store waits before it compresses the rows that may
  // still be cut (fp16 slots compress nothing).
  core_.hold_compression_above(limit() > budget_ ? budget_ : EvictionPolicy::kUnbounded);
}

void DeviceEvictionCache::adopt(std::optional<std::size_t> budget, cudaStream_t stream) {
  if (!budget) return;
  budget_ = *budget;
  // The host core trims (it may have been behind the decode kernel's mirror), the device store
  // follows: moves, then a smaller store when the trim freed enough.
  HostClock clock;
  store_->set_stream(stream);
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  host_times_.wait_ms += clock.lap();
  // The drop decided where the rows are (select_lowest.h): no metadata read back, none written.
  const std::size_t rows = core_.rows();
  if (rows > budget_ && !core_.fell_back() && !core_.has_row_weights() && scores_by_attention(core_.policy().scoring)) {
    hold_while_uncertain();
    if (store_->drop_lowest_on_device(rows, rows - budget_, core_.recent_threshold(budget_), core_.policy().n_sink,
                                      std::min(fresh_from_, rows))) {
      core_.trimmed_by_owner(budget_);
      store_->flush();
      host_stale_ = true;
      ++trims_on_device_;
      device_trim_ms_ += clock.lap();
      fresh_from_ = core_.rows();
      return;
    }
  }
  pull_metadata();
  host_times_.pull_ms += clock.lap();
  hold_while_uncertain();
  core_.trim(budget_);
  host_times_.core_ms += clock.lap();
  store_->flush();
  push_metadata(stream);
  host_times_.flush_push_ms += clock.lap();
  ++host_times_.calls;
  fresh_from_ = core_.rows();
}

HeadTerms DeviceEvictionCache::key_dispersion(const AppendInput& in, cudaStream_t stream) const {
  const std::size_t BH = static_cast<std::size_t>(in.BH);
  DeviceBuffer scores;
  scores.reserve(BH * sizeof(double));
  launch_kernel(true, false, key_dispersion_kernel, dim3(static_cast<unsigned>(BH)), dim3(kDispersionThreads),
                (in.D + 1) * sizeof(double), stream, in.keys, in.dtype, in.S, in.D, scores.as<double>());
  std::vector<double> per_head(BH);
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(per_head.data(), scores.get(), BH * sizeof(double), cudaMemcpyDeviceToHost, stream));
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  // As the host cache reports: every (batch, head) as a term, or head 0 alone (HeadTerms).
  return HeadTerms::per_head(per_head, batch_, squeeze_->first_head_only());
}

DeviceEvictionCache::~DeviceEvictionCache() {
  DeviceGuard guard(device());
  cudaStreamSynchronize(stream());
  if (probs_host_) cudaFreeHost(probs_host_);
}

void DeviceEvictionCache::absorb(const AppendInput& in, const std::vector<std::int64_t>& positions, cudaStream_t stream) {
  if (core_.awaiting_observation()) {
    throw InputError(std::string(method()) +
                     " cache (cuda): the attention of the last append was never observed; a device eviction cache is "
                     "scored by the attention its caller reports (attend with probs, then observe_attention with them "
                     "after every append)");
  }
  if (squeeze_) adopt(squeeze_->before_absorb([&] { return key_dispersion(in, stream); }), stream);
  const std::size_t n0 = core_.rows();
  if (n0 == 0 && slots_) slots_->set_type(in.dtype == DType::bf16 ? DenseType::bf16 : DenseType::f16);
  prompt_from_empty_ = n0 == 0 && positions.size() > 1;
  for (std::size_t i = 1; prompt_from_empty_ && i < positions.size(); ++i) {
    prompt_from_empty_ = positions[i] == positions[i - 1] + 1;
  }
  prompt_p0_ = positions.empty() ? 0 : positions[0];
  fresh_from_ = n0;
  store_->set_stream(stream);
  store_->set_capturing(capturing());
  struct Release {
    DeviceRowStore* s;
    ~Release() {
      s->set_capturing(false);
      s->set_arrival(nullptr);
    }
  } release{store_};
  // The rows land after the kept ones once the core has made room (DeviceRowStore::prepare),
  // before it admits them (streaming moves them to their slots; attention scorings keep them there).
  store_->set_arrival([&] { store_->place(in, n0, stream); });
  if (streams_on_device(in, positions)) {
    evict_oldest_on_device(positions[0], stream);
    return;
  }
  if (!scores_by_attention(core_.policy().scoring)) {
    pull_metadata();  // streaming over codes: the rows the device's steps erased, before the host decides
    streaming_mirror_current_ = false;
  }
  hold_while_uncertain();
  core_.absorb_placed(batch_, heads_, dim_, positions.data(), static_cast<std::size_t>(in.S), limit());
  store_->flush();  // streaming's moves of this step, before the next append lands where they read
}

bool DeviceEvictionCache::streams_on_device(const AppendInput& in, const std::vector<std::int64_t>& positions) const {
  return slots_ == nullptr && !squeeze_ && in.S == 1 && core_.policy().scoring == Scoring::none &&
         core_.owner_may_admit(limit(), positions[0]);
}

void DeviceEvictionCache::evict_oldest_on_device(std::int64_t position, cudaStream_t stream) {
  const std::size_t limit = this->limit();
  if (!streaming_mirror_current_) {
    // The host decided the steps before: its metadata (the sinks, the scores) into the mirror once.
    // (graph_check_capturable refuses a capture until then: this copy waits for the stream.)
    if (in_graph_step()) throw std::logic_error("streaming over kivi codes: a replayed step found its mirror stale");
    push_metadata(stream);
    streaming_mirror_current_ = true;
  }
  store_->prepare(1);  // room in the window, then the append kernel places the row after the kept ones
  DevicePackedRows::DecodeStep step;  // no probabilities: by position
  step.rows = limit + 1;
  step.limit = limit;
  step.qpos = std::numeric_limits<std::int64_t>::max();
  step.threshold = core_.admit_by_owner(position, limit);
  step.decay = 1.f;  // scoring none never decays (every score stays as the host left it)
  // (then the compression the core's settle() runs after an admission)
  decode_codes_step(step, stream);
}

void DeviceEvictionCache::decode_codes_step(const DevicePackedRows::DecodeStep& step, cudaStream_t stream) {
  auto* codes = static_cast<DevicePackedRows*>(store_);
  const std::size_t parts = observe_parts(batch_ * heads_, step.rows, sm_count_);
  reserve_observe_parts(parts, stream);
  codes->observe_decode(step, observe_best_.get(), observe_arrivals_.as<unsigned>(), parts, stream);
  core_.observed_by_owner(std::min(step.rows, step.limit), step.limit);
  fresh_from_ = core_.rows();
  host_stale_ = true;
  ++decode_steps_on_device_;
  // What the host core's observe() / settle() ends with: the rows that waited may be compressed now
  // (held while squeeze's deferred schedule may still cut rows, as the core holds them). A replayed
  // step's graph cannot hold that work: it runs between this replay and the next (graph_between_steps).
  if (!in_graph_step() && !compression_held() && codes->settle_would_act()) codes->settle(core_.rows(), {});
}

void DeviceEvictionCache::observe_attention(const AttentionObservation& obs) {
  if (!needs().attention) return;
  DeviceGuard guard(device());
  const std::string who = std::string(method()) + " cache (cuda)";
  if (capturing()) {
    // The step's observation becomes the decode kernel's node (graph_observe re-arms it).
    if (!step_->attended || step_->observed || obs.space != MemorySpace::cuda || obs.probs != step_->probs ||
        obs.queries != 1 || obs.tokens != core_.rows() || obs.stride != obs.tokens) {
      throw InputError(who + ": a captured step observes once, the probabilities of its own attend (one query over "
                             "every row) (StepGraph)");
    }
    LaunchScope scope(step_->slots, LaunchSlots::Mode::capture);
    if (!observe_on_device(obs)) {
      throw InputError(who + ": this step's observation is decided on the host (more than one row over the budget, or "
                             "the core fell back to the key proxy): no graph can replay it (StepGraph)");
    }
    step_->observation = obs;
    step_->observation.query_positions = {};
    step_->observed = true;
    return;
  }
  raise_pending_error();
  HostClock clock;
  AttentionObservation host = obs;
  const auto stream = static_cast<cudaStream_t>(obs.stream);
  if (obs.space == MemorySpace::cuda) {
    if (obs.probs == nullptr || obs.batch != batch_ || obs.heads != heads_ || obs.tokens != core_.rows() ||
        obs.stride < obs.tokens || obs.queries == 0 ||
        (!obs.query_positions.empty() && obs.query_positions.size() != obs.queries)) {
      throw InputError(who + ": attention observation [" + std::to_string(obs.batch) + ", " + std::to_string(obs.heads) +
                       ", " + std::to_string(obs.queries) + ", " + std::to_string(obs.tokens) + "] does not match [" +
                       std::to_string(batch_) + ", " + std::to_string(heads_) + ", q, " + std::to_string(core_.rows()) +
                       "] (the rows after the last append), or its query positions do not match its queries");
    }
    check_device_pointer(method(), obs.probs, device(), "probs");
    if (observe_on_device(obs) || prompt_on_device(obs, who)) {
      // squeeze: the step's pending report (the key dispersion measured at the append), and the
      // budget to adopt if it finalised the schedule.
      if (squeeze_) adopt(squeeze_->after_step(core_), stream);
      return;
    }
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_times_.wait_ms += clock.lap();
    const std::size_t rows = obs.batch * obs.heads * obs.queries, floats = rows * obs.tokens;
    if (floats > probs_host_floats_) {
      if (probs_host_) KVSLIM_CUDA_CHECK(cudaFreeHost(probs_host_));
      probs_host_ = nullptr;
      KVSLIM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&probs_host_), floats * sizeof(float), cudaHostAllocDefault));
      probs_host_floats_ = floats;
    }
    if (floats > 0) {
      KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(probs_host_, obs.tokens * sizeof(float), obs.probs, obs.stride * sizeof(float),
                                          obs.tokens * sizeof(float), rows, cudaMemcpyDeviceToHost, stream));
      KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    host.probs = probs_host_;
    host.stride = obs.tokens;
    host.space = MemorySpace::host;
    host_times_.probs_ms += clock.lap();
  }
  store_->set_stream(stream);
  if (obs.queries > 1 && core_.policy().cross_layer > 0.0f) {
    const auto board = device_board();
    if (board && board->holds_call(core_.prefill_calls())) {
      throw std::logic_error(who + ": this prompt is decided on the host while other layers of the same call exchanged "
                                   "importance on the device board (the layers of one model must take one path)");
    }
  }
  pull_metadata();
  host_times_.pull_ms += clock.lap();
  if (squeeze_) squeeze_->observe_attention(host, core_, who);  // its signal reads the rows before they go
  hold_while_uncertain();
  core_.observe(host, limit(), who);
  host_times_.core_ms += clock.lap();
  store_->flush();
  push_metadata(stream);
  host_times_.flush_push_ms += clock.lap();
  ++host_times_.calls;
  fresh_from_ = core_.rows();
  if (squeeze_) adopt(squeeze_->after_step(core_), stream);
  // A prompt's window of probabilities is large (16 queries x every row of every head) and needed
  // once: pinned host memory is not kept for it.
  if (probs_host_floats_ * sizeof(float) > kKeptProbsBytes) {
    KVSLIM_CUDA_CHECK(cudaFreeHost(probs_host_));
    probs_host_ = nullptr;
    probs_host_floats_ = 0;
  }
}

std::shared_ptr<DeviceImportanceBoard> DeviceEvictionCache::device_board() const {
  if (!board_) return nullptr;
  return std::static_pointer_cast<DeviceImportanceBoard>(
      board_->attachment([] { return std::static_pointer_cast<void>(std::make_shared<DeviceImportanceBoard>()); }));
}

bool DeviceEvictionCache::prompt_on_device(const AttentionObservation& obs, const std::string& who) {
  const EvictionPolicy& policy = core_.policy();
  const std::size_t n = core_.rows();
  // A first prompt of an attention-scored policy (squeeze's too, unless its layer signal still reads
  // the probabilities or the scores on the host), without a prior or row weights, whose rows the
  // store holds in position order.
  if (obs.queries < 2 || (squeeze_ && squeeze_->signal_reads_observation()) || !prompt_from_empty_ ||
      !scores_by_attention(policy.scoring) ||
      !core_.owner_may_score_prompt() || n == 0 || n > static_cast<std::size_t>(std::numeric_limits<int>::max()) ||
      obs.queries > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    return false;
  }
  // The exchange on the device board, unless the host board already holds this call's posts (a
  // host decision came first) or gathers over ranks (tensor parallelism: the host's collective).
  const bool shares = board_ != nullptr && policy.cross_layer > 0.0f;
  if (shares && (board_->gathers() || board_->holds_posts())) return false;
  const auto stream = static_cast<cudaStream_t>(obs.stream);
  HostClock clock;
  store_->set_stream(stream);
  const std::int64_t sink_position =
      policy.n_sink == 0 ? std::numeric_limits<std::int64_t>::min()
                         : prompt_p0_ + static_cast<std::int64_t>(std::min<std::size_t>(policy.n_sink, n)) - 1;
  PromptRows rows;
  if (!store_->prompt_rows(n, sink_position, rows)) return false;
  PromptWindow w;
  w.probs = obs.probs;
  w.probs_stride = static_cast<long long>(obs.stride);
  w.heads = static_cast<int>(batch_ * heads_);
  w.heads_per_row = static_cast<int>(heads_);
  w.Q = static_cast<int>(obs.queries);
  w.first = policy.obs_window > 0 && obs.queries > policy.obs_window ? static_cast<int>(obs.queries - policy.obs_window) : 0;
  w.decay = policy.decay;
  w.normalized = policy.scoring == Scoring::attention_normalized;
  w.pool_half = static_cast<int>(policy.pool_kernel / 2);
  w.rows = static_cast<int>(n);
  // A non-finite weight is named as the host names it, before anything changes.
  const long long bad = first_nonfinite_probability(w, stream);
  if (bad >= 0) {
    const auto at = static_cast<std::size_t>(bad), rows_n = static_cast<std::size_t>(w.rows);
    const std::size_t vec = at / rows_n, head = vec / static_cast<std::size_t>(w.Q);
    throw_nonfinite_weight(who, head / heads_, head % heads_, vec % static_cast<std::size_t>(w.Q), at % rows_n);
  }
  DeviceBuffer qpos, scratch;
  if (!obs.query_positions.empty()) {
    qpos.upload(obs.query_positions.data(), obs.query_positions.size() * sizeof(std::int64_t), stream);
    w.qpos = qpos.as<std::int64_t>();
  }
  scratch.reserve(2 * static_cast<std::size_t>(w.heads) * n * sizeof(float), stream);
  const std::size_t call = core_.prefill_calls();
  const bool exchanged = core_.begin_owner_prompt(obs, who);
  std::shared_ptr<DeviceImportanceBoard> board;
  DeviceImportanceBoard::View view;
  try {
    if (exchanged) {
      board = device_board();
      view = board->begin(call, static_cast<unsigned>(board_layer_), policy.cross_layer, batch_, n, prompt_p0_, stream);
    }
    launch_prompt_scoring(w, rows, exchanged ? &view : nullptr, scratch.as<float>(), stream);
    if (exchanged) board->merge(view, stream);
  } catch (...) {
    if (board) board->discard(stream);
    core_.end_owner_prompt(exchanged, EvictionPolicy::kUnbounded, false);
    throw;
  }
  // Every row is observed now; the mirrors hold the scores the core would hold.
  host_stale_ = true;
  fresh_from_ = n;
  const std::size_t limit = this->limit();
  bool dropped = false;
  if (n > limit) {
    dropped = store_->drop_lowest_on_device(n, n - limit, core_.recent_threshold(limit), policy.n_sink, n);
    if (!dropped) pull_metadata();  // the core drops from the device's scores (and names a logic error)
  }
  hold_while_uncertain();
  core_.end_owner_prompt(exchanged, limit, dropped);
  store_->flush();
  if (n > limit && !dropped) push_metadata(stream);
  fresh_from_ = core_.rows();
  prompt_from_empty_ = false;
  ++prompts_on_device_;
  device_prompt_ms_ += clock.lap();
  return true;
}

bool DeviceEvictionCache::observe_on_device(const AttentionObservation& obs) {
  const std::size_t n = core_.rows();
  // One query (a decode step) with at most one row to drop. Device probabilities are not checked
  // for NaN/Inf here (that would wait for the stream): the cache's own attend writes finite ones,
  // and a non-finite score is never the lowest (it only shields its row).
  const std::size_t limit = this->limit();
  const auto stream = static_cast<cudaStream_t>(obs.stream);
  const DeferredProbs deferred = take_deferred_probs();
  // (Over codes the logits span the store's padding too: the observation writes slot order.)
  const bool computes_probs = deferred.probs != nullptr && deferred.probs == obs.probs &&
                              (slots_ == nullptr || deferred.query.rows_total == static_cast<long long>(obs.stride));
  if (obs.queries != 1 || n > limit + 1 || core_.fell_back() || (deferred.probs != nullptr && !computes_probs)) {
    // The probabilities attend left to this observation are computed now, as attend would have.
    if (deferred.probs != nullptr) fill_probs(deferred, stream);
    return false;
  }
  if (slots_ == nullptr) return observe_codes_on_device(obs, computes_probs ? &deferred : nullptr);
  const EvictionPolicy& policy = core_.policy();
  DecodeObservation o;
  o.probs = obs.probs;
  o.probs_stride = static_cast<long long>(obs.stride);
  if (computes_probs) {
    o.probs_out = deferred.written ? deferred.probs : nullptr;
    o.logits = deferred.query.logits;
    o.final_ml = deferred.final_ml;
    o.G = deferred.query.G;
  }
  o.k = slots_->keys();
  o.v = slots_->values();
  o.pos = slots_->positions();
  o.scores = slots_->scores();
  o.exposure = slots_->exposure();
  o.stride = static_cast<long long>(slots_->stride());
  o.D = static_cast<int>(dim_);
  o.n_rows = static_cast<int>(n);
  o.fresh_from = static_cast<int>(fresh_from_);
  o.n_sink = static_cast<int>(policy.n_sink);
  o.limit = static_cast<int>(limit);
  o.qpos = obs.query_positions.empty() ? std::numeric_limits<std::int64_t>::max() : obs.query_positions[0];
  o.threshold = core_.recent_threshold(n > limit ? limit : n);
  o.decay = policy.decay;
  const std::size_t BH = batch_ * heads_;
  const std::size_t parts = observe_parts(BH, n, sm_count_);
  reserve_observe_parts(parts, stream);
  launch_kernel(true, false, observe_decode_kernel, dim3(static_cast<unsigned>(BH), static_cast<unsigned>(parts)),
                dim3(kObserveThreads), 0, stream, o, observe_best_.as<Candidate>(), observe_arrivals_.as<unsigned>());
  core_.observed_by_owner(std::min(n, limit), limit);
  fresh_from_ = core_.rows();
  host_stale_ = true;
  ++decode_steps_on_device_;
  return true;
}

void DeviceEvictionCache::reserve_observe_parts(std::size_t parts, cudaStream_t stream) {
  const std::size_t BH = batch_ * heads_;
  if (parts <= 1 || observe_parts_capacity_ >= BH * parts) return;
  if (capturing()) {
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: a captured step needs the decode observation's "
                     "scratch for " + std::to_string(parts) + " parts per head: run one eager decode step before capturing");
  }
  observe_best_.reserve(BH * parts * sizeof(Candidate), stream);
  observe_arrivals_.reserve(BH * sizeof(unsigned), stream);
  KVSLIM_CUDA_CHECK(cudaMemsetAsync(observe_arrivals_.get(), 0, BH * sizeof(unsigned), stream));
  observe_parts_capacity_ = BH * parts;
}

bool DeviceEvictionCache::observe_codes_on_device(const AttentionObservation& obs, const DeferredProbs* deferred) {
  const std::size_t n = core_.rows(), limit = this->limit();
  const auto stream = static_cast<cudaStream_t>(obs.stream);
  DevicePackedRows::DecodeStep step;
  // This cache's own attend left its probabilities over the rows it spanned too: read those (or,
  // deferred, compute them from its logits and write them in slot order unless nobody reads them).
  const SpannedProbs spanned = last_spanned_probs();
  if (deferred != nullptr) {
    step.probs_out = deferred->written ? deferred->probs : nullptr;
    step.logits = deferred->query.logits;
    step.final_ml = deferred->final_ml;
    step.G = deferred->query.G;
    step.out_stride = static_cast<long long>(obs.stride);
  } else if (spanned.probs == obs.probs && spanned.spanned != nullptr) {
    step.probs = spanned.spanned;
    step.probs_stride = spanned.rows_total;
  } else {
    step.probs = obs.probs;
    step.probs_stride = static_cast<long long>(obs.stride);
    step.slot_order = true;
  }
  step.rows = n;
  step.limit = limit;
  step.qpos = obs.query_positions.empty() ? std::numeric_limits<std::int64_t>::max() : obs.query_positions[0];
  step.threshold = core_.recent_threshold(n > limit ? limit : n);
  step.decay = core_.policy().decay;
  decode_codes_step(step, stream);
  return true;
}

void DeviceEvictionCache::graph_between_steps(cudaStream_t stream) {
  if (slots_ != nullptr) return;
  static_cast<DevicePackedRows*>(store_)->between_replays(core_.rows(), !compression_held(), stream);
}

void DeviceEvictionCache::graph_reserve_step() {
  if (slots_ == nullptr) static_cast<DevicePackedRows*>(store_)->reserve_next_step();
}

void DeviceEvictionCache::graph_check_capturable() const {
  if (slots_ == nullptr && !scores_by_attention(core_.policy().scoring) && !streaming_mirror_current_) {
    // Its first decode step on the device uploads the host's metadata (a copy that waits).
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: streaming over kivi codes replays after one "
                     "decode step at its budget (" + std::to_string(budget_) + " rows per head) ran eagerly on the "
                     "device; decode one step eagerly first");
  }
  if (!graph_next_step_replays()) {
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: the next step compresses the window before it "
                     "attends (StepGraph::next_step_replays is false): take it eagerly, then capture");
  }
  if (squeeze_ && !squeeze_->adopted()) {
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: capture a decode step once squeeze's schedule "
                     "is final and adopted (after the prompt of every layer and one decode step)");
  }
  if (core_.rows() != budget_ || core_.fell_back() || core_.awaiting_observation()) {
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: capture a decode step once the cache holds its "
                     "budget (" + std::to_string(budget_) + " rows per head, now " + std::to_string(core_.rows()) +
                     "), every step observed: until then a step's probabilities change shape");
  }
}

bool DeviceEvictionCache::graph_next_step_replays() const {
  if (slots_ != nullptr || scores_by_attention(core_.policy().scoring)) return true;
  // streaming over kivi codes: the core compresses (or re-packs) right after it admits a row, before
  // the step attends (the CPU cache's order), which no replay can hold: such a step runs eagerly.
  return !static_cast<const DevicePackedRows*>(store_)->settle_may_act_after_step();
}

void DeviceEvictionCache::graph_observe(const AttentionObservation& obs) {
  if (!observe_on_device(obs)) {
    throw InputError(std::string(method()) + " cache (cuda): StepGraph: this step's observation is decided on the host; "
                     "capture again");
  }
}

void DeviceEvictionCache::pull_metadata() {
  if (!host_stale_) return;
  // Positions of every row; scores and exposure of the rows observed (the later ones are the
  // core's fresh zeros: the mirror holds nothing for them yet).
  const std::size_t rows = core_.rows();
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream()));  // the decode kernels ran on the caller's stream
  store_->download_metadata(core_.metadata(), rows, std::min(fresh_from_, rows));
  host_stale_ = false;
}

void DeviceEvictionCache::push_metadata(cudaStream_t stream) {
  if (core_.rows() == 0) return;
  store_->set_stream(stream);
  store_->upload_metadata(core_.metadata(), core_.rows(), core_.policy().n_sink);
}

int DeviceEvictionCache::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only,
                                         cudaStream_t stream) const {
  return store_->launch_segments(q, parts, count_only, core_.rows(), scores_by_attention(core_.policy().scoring),
                                 sm_count_, stream);
}

void DeviceEvictionCache::download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const {
  store_->download_head(bh, core_.rows(), keys, values);
}

void DeviceEvictionCache::head_positions(std::size_t bh, std::int64_t* out) const {
  store_->head_positions(bh, core_.rows(), out);
}

std::size_t DeviceEvictionCache::host_bytes() const {
  return core_.resident_bytes() - store_->resident_bytes() + store_->host_bytes() + probs_host_floats_ * sizeof(float);
}

void DeviceEvictionCache::clear() {
  core_.reset();
  observe_best_.release();
  observe_arrivals_.release();
  observe_parts_capacity_ = 0;
  decode_steps_on_device_ = 0;
  host_times_ = {};
  trims_on_device_ = 0;
  device_trim_ms_ = 0;
  fresh_from_ = 0;
  host_stale_ = false;
  streaming_mirror_current_ = false;
  if (squeeze_) budget_ = squeeze_->reset(budget_);
}

void DeviceEvictionCache::add_figures(CacheStats& st) const {
  st.figures.emplace_back("layer_budget", static_cast<double>(budget_));
  st.figures.emplace_back("decode_steps_on_device", static_cast<double>(decode_steps_on_device_));
  st.figures.emplace_back("trims_on_device", static_cast<double>(trims_on_device_));
  st.figures.emplace_back("prompts_on_device", static_cast<double>(prompts_on_device_));
  st.figures.emplace_back("device_prompt_ms", device_prompt_ms_);
  st.figures.emplace_back("device_trim_ms", device_trim_ms_);
  st.figures.emplace_back("host_decisions", static_cast<double>(host_times_.calls));
  st.figures.emplace_back("host_decision_wait_ms", host_times_.wait_ms);
  st.figures.emplace_back("host_decision_probs_ms", host_times_.probs_ms);
  st.figures.emplace_back("host_decision_pull_ms", host_times_.pull_ms);
  st.figures.emplace_back("host_decision_core_ms", host_times_.core_ms);
  st.figures.emplace_back("host_decision_flush_push_ms", host_times_.flush_push_ms);
  if (slots_ == nullptr) store_->add_figures(st);
  if (squeeze_) squeeze_->add_figures(st, limit());
}

}  // namespace kvslim::cuda
