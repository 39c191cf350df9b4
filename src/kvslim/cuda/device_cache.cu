#include "cuda/device_cache.h"
#include "cuda/device_eviction_cache.h"
#include "cuda/device_packed_rows.h"
#include "cuda/device_zip_cache.h"
#include "cuda/env_switch.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cache/block_intake.h"
#include "kvslim/cuda.h"
#include "kvslim/dtype.h"
#include "kvslim/errors.h"
#include "kvslim/methods.h"
#include "quant/quant_kernels.h"

namespace kvslim::cuda {

void reject(std::string_view method, const std::string& what) {
  throw InputError(std::string(method) + " cache (cuda): " + what);
}

namespace {

std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

// Sets a flag for the scope (graph_arm's re-arming; attend_and_observe's unread probabilities).
struct ScopedFlag {
  bool& flag;
  explicit ScopedFlag(bool& f) : flag(f) { flag = true; }
  ~ScopedFlag() { flag = false; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;
};

}  // namespace

void check_device_pointer(std::string_view method, const void* p, int device, const char* name) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the pointer is simply not CUDA's
    reject(method, std::string(name) + " is not CUDA memory (" + cudaGetErrorString(err) + ")");
  }
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) || attr.device != device) {
    reject(method, std::string(name) + " is not memory of cuda:" + std::to_string(device) +
                       " (the cache lives there; host or other-device data is never copied implicitly)");
  }
}

void copy_head_rows(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride, std::size_t rows,
                    std::size_t BH, std::size_t row_bytes, cudaStream_t stream) {
  if (rows == 0 || BH == 0) return;
  KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride * row_bytes, src, src_stride * row_bytes, rows * row_bytes, BH,
                                      cudaMemcpyDeviceToDevice, stream));
}

void download_dense_head(const std::uint16_t* k, const std::uint16_t* v, DenseType type, std::size_t stride,
                         std::size_t D, std::size_t bh, std::size_t n, std::uint16_t* keys, std::uint16_t* values) {
  KVSLIM_CUDA_CHECK(cudaMemcpy(keys, k + bh * stride * D, n * D * 2, cudaMemcpyDeviceToHost));
  KVSLIM_CUDA_CHECK(cudaMemcpy(values, v + bh * stride * D, n * D * 2, cudaMemcpyDeviceToHost));
  if (type == DenseType::bf16) {
    for (std::size_t i = 0; i < n * D; ++i) {
      keys[i] = f32_to_fp16(bf16_to_f32(keys[i]));
      values[i] = f32_to_fp16(bf16_to_f32(values[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// DeviceCache

DeviceCache::DeviceCache(std::string method, int device) : method_(std::move(method)), device_(device) {
  DeviceGuard guard(device_);
  KVSLIM_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
  bad_.reserve(sizeof(int));
  const int none = INT_MAX;
  KVSLIM_CUDA_CHECK(cudaMemcpy(bad_.get(), &none, sizeof(int), cudaMemcpyHostToDevice));
  KVSLIM_CUDA_CHECK(cudaHostAlloc(&bad_host_, sizeof(int), cudaHostAllocMapped));
  KVSLIM_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&bad_host_device_), bad_host_, 0));
  *bad_host_ = INT_MAX;
  KVSLIM_CUDA_CHECK(cudaEventCreateWithFlags(&flag_event_, cudaEventDisableTiming));
}

DeviceCache::~DeviceCache() {
  DeviceGuard guard(device_);
  cudaStreamSynchronize(stream_);  // our kernels may still read the buffers
  if (flag_event_) cudaEventDestroy(flag_event_);
  if (bad_host_) cudaFreeHost(bad_host_);
}

void DeviceCache::check_pending_error(bool wait) const {
  if (poisoned_) throw InputError(poison_message_);
  const cudaError_t st = wait ? cudaEventSynchronize(flag_event_) : cudaEventQuery(flag_event_);
  if (st == cudaErrorNotReady) return;
  KVSLIM_CUDA_CHECK(st);
  if (*bad_host_ != INT_MAX) {
    poisoned_ = true;
    poison_message_ = method_ + " cache (cuda): an earlier append held a NaN, infinite or out-of-fp16-range "
                      "(|x| > 65504) value in keys or values (at row " + std::to_string(*bad_host_) +
                      " of that block's [batch * heads * tokens]); the cache refuses every call until reset()";
    throw InputError(poison_message_);
  }
}

void DeviceCache::synchronize() const {
  DeviceGuard guard(device_);
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  check_pending_error(true);
}

void DeviceCache::append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) {
  DeviceGuard guard(device_);
  const bool capture = capturing();
  if (capture && step_->appended) reject(method_, "a captured step appends once (StepGraph)");
  if (!capture) check_pending_error(false);
  std::vector<std::int64_t> resolved =
      check_append(method_, MemorySpace::cuda, keys, values, positions, batch_, heads_, dim_, next_position_);
  if (keys.dtype != values.dtype) {
    reject(method_, "keys are " + std::string(dtype_name(keys.dtype)) + " and values " +
                        std::string(dtype_name(values.dtype)) + "; a device append takes one element type for both");
  }
  if (!supported_head_dim(static_cast<int>(keys.head_dim))) {
    reject(method_, "keys " + keys.shape_string() + ": the device kernels take head_dim 64 or 128");
  }
  const std::size_t BH = keys.batch * keys.heads;
  if (BH * keys.tokens >= static_cast<std::size_t>(INT_MAX) / 2 || BH > 65535 || keys.tokens > INT_MAX / 4) {
    reject(method_, "keys " + keys.shape_string() + ": too many rows for one device append");
  }
  check_device_pointer(method_, keys.data, device_, "keys.data");
  check_device_pointer(method_, values.data, device_, "values.data");
  const auto stream = static_cast<cudaStream_t>(keys.stream);

  AppendInput in;
  in.keys = keys.data;
  in.values = values.data;
  in.dtype = keys.dtype;
  in.BH = static_cast<int>(BH);
  in.S = static_cast<int>(keys.tokens);
  in.D = static_cast<int>(keys.head_dim);
  in.first_position = resolved[0];
  in.bad_element = bad_.as<int>();
  in.bad_host = bad_host_device_;
  bool contiguous = true;
  for (std::size_t s = 1; s < resolved.size() && contiguous; ++s) contiguous = resolved[s] == resolved[0] + static_cast<std::int64_t>(s);
  if (capture && (!contiguous || resolved[0] != next_position_)) {
    reject(method_, "a captured step appends at the next positions, in order (StepGraph)");
  }
  DeviceBuffer uploaded;
  if (!contiguous) {
    uploaded.reserve(resolved.size() * sizeof(std::int64_t));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(uploaded.get(), resolved.data(), resolved.size() * sizeof(std::int64_t),
                                      cudaMemcpyHostToDevice, stream));
    in.positions = uploaded.as<std::int64_t>();
  }
  if (batch_ == 0) {
    batch_ = keys.batch;
    heads_ = keys.heads;
    dim_ = keys.head_dim;
  }
  stream_ = stream;
  if (capture) {
    LaunchScope scope(step_->slots, LaunchSlots::Mode::capture);
    absorb_step(in, resolved, stream);
    step_->append = in;
    step_->appended = true;
    return;  // the input-error event is recorded after each replay (graph_launched)
  }
  absorb_step(in, resolved, stream);
  KVSLIM_CUDA_CHECK(cudaEventRecord(flag_event_, stream));
  if (!contiguous) KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));  // `uploaded` dies here
}

void DeviceCache::absorb_step(const AppendInput& in, const std::vector<std::int64_t>& resolved, cudaStream_t stream) {
  absorb(in, resolved, stream);
  if (mirror_positions_) positions_.insert(positions_.end(), resolved.begin(), resolved.end());
  tokens_seen_ += static_cast<std::uint64_t>(in.S);
  next_position_ = resolved.back() + 1;
}

void DeviceCache::attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out,
                         float* probs, const ParallelFor*) const {
  DeviceGuard guard(device_);
  const auto fail = [&](const std::string& what) { reject(method_, "attend: " + what); };
  if (queries.space != MemorySpace::cuda) {
    fail("queries are in " + std::string(memory_space_name(queries.space)) + " memory; this cache is on cuda:" +
         std::to_string(device_) + " (queries, out and probs must be device memory there)");
  }
  const bool capture = capturing();
  if (!capture) check_pending_error(false);
  if (queries.tokens == 0) return;
  if (queries.data == nullptr || out == nullptr) fail("queries and out must not be null");
  if (query_positions.size() != queries.tokens) {
    fail(std::to_string(query_positions.size()) + " query positions for " + std::to_string(queries.tokens) +
         " query tokens");
  }
  if (!std::isfinite(queries.scale)) fail("scale must be finite");
  check_device_pointer(method_, queries.data, device_, "queries.data");
  check_device_pointer(method_, out, device_, "out");
  if (probs) check_device_pointer(method_, probs, device_, "probs");
  if (probs && !gives_probabilities()) {
    fail("this cache on cuda reports no attention probabilities (it keeps each head's rows out of token order); "
         "attend with probs = null");
  }
  const auto stream = static_cast<cudaStream_t>(queries.stream);
  const std::size_t out_elems = queries.batch * queries.tokens * queries.heads * queries.head_dim;
  if (batch_ == 0) {
    if (capture) fail("a captured step attends after its append (StepGraph)");
    if (queries.heads == 0 || queries.head_dim == 0) fail("queries need heads >= 1 and head_dim >= 1");
    KVSLIM_CUDA_CHECK(cudaMemsetAsync(out, 0, out_elems * sizeof(float), stream));
    return;
  }
  if (queries.batch != batch_ || queries.head_dim != dim_ || queries.heads == 0 || queries.heads % heads_ != 0) {
    fail("queries [batch=" + std::to_string(queries.batch) + ", tokens=" + std::to_string(queries.tokens) +
         ", heads=" + std::to_string(queries.heads) + ", head_dim=" + std::to_string(queries.head_dim) +
         "] do not match the cache [batch=" + std::to_string(batch_) + ", kv_heads=" + std::to_string(heads_) +
         ", head_dim=" + std::to_string(dim_) + "] (heads must be a multiple of kv_heads)");
  }
  if (queries.tokens * queries.heads / heads_ > static_cast<std::size_t>(INT_MAX) / 8) fail("too many query vectors");
  if (capture) {
    // A replayed step's queries are its own new tokens, their positions passed with the launch.
    if (!step_->appended || step_->attended) fail("a captured step attends once, after its append (StepGraph)");
    if (probs && !graph_observes()) {
      fail("a captured step of this cache computes no probabilities (their [.., rows] shape changes every step)");
    }
    if (queries.tokens != static_cast<std::size_t>(step_->append.S)) fail("a captured step attends its own new tokens");
    for (std::size_t i = 0; i < queries.tokens; ++i) {
      if (query_positions[i] != step_->append.first_position + static_cast<std::int64_t>(i)) {
        fail("a captured step attends at the positions it appended");
      }
    }
  }
  stream_ = stream;
  const QueryArgs q = query_args(queries, query_positions);
  if (capture) {
    LaunchScope scope(step_->slots, LaunchSlots::Mode::capture);
    // A cache whose captured step must observe (graph_captured refuses one that does not) leaves
    // the probabilities to the observation's kernel.
    attend_checked(q, out, probs, stream, probs_by(probs, q.S, true, probs_unread_));
    step_->queries = queries;
    step_->out = out;
    step_->probs = probs;
    step_->probs_unread = probs_unread_;
    step_->probs_rows = orders_probs() ? static_cast<long long>(rows()) : q.rows_total;
    step_->attended = true;
    return;
  }
  attend_checked(q, out, probs, stream, probs_by(probs, q.S, false, probs_unread_));
}

void DeviceCache::attend_and_observe(const QueryBlock& queries, std::span<const std::int64_t> query_positions,
                                     float* out, float* probs, std::size_t kv_heads, const ParallelFor* parallel) {
  // KVCache's sequence, with attend told that only the observation reads its probabilities.
  // KVSLIM_CUDA_UNREAD_PROBS=0 writes them as attend + observe_attention would (the benchmarks' A/B).
  static const bool unread_allowed = env_switch("KVSLIM_CUDA_UNREAD_PROBS", true);
  bool ignored = false;  // the A/B sets this flag instead, which nothing reads
  const ScopedFlag unread(unread_allowed ? probs_unread_ : ignored);
  KVCache::attend_and_observe(queries, query_positions, out, probs, kv_heads, parallel);
}

QueryArgs DeviceCache::query_args(const QueryBlock& queries, std::span<const std::int64_t> query_positions) const {
  QueryArgs q;
  q.q = queries.data;
  q.B = static_cast<int>(batch_);
  q.S = static_cast<int>(queries.tokens);
  q.Hq = static_cast<int>(queries.heads);
  q.Hkv = static_cast<int>(heads_);
  q.G = q.Hq / q.Hkv;
  q.D = static_cast<int>(dim_);
  const float scale = queries.scale == 0.f ? 1.f / std::sqrt(static_cast<float>(dim_)) : queries.scale;
  q.scale_log2 = scale * 1.4426950408889634f;
  q.rows_total = attention_rows();
  if (queries.tokens <= static_cast<std::size_t>(kInlinePositions)) {
    std::copy(query_positions.begin(), query_positions.end(), q.qpos_inline);
  } else {
    qpos_.reserve(queries.tokens * sizeof(std::int64_t));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(qpos_.get(), query_positions.data(), queries.tokens * sizeof(std::int64_t),
                                      cudaMemcpyHostToDevice, static_cast<cudaStream_t>(queries.stream)));
    q.qpos = qpos_.as<std::int64_t>();
  }
  return q;
}

void DeviceCache::attend_checked(const QueryArgs& q_in, float* out, float* probs, cudaStream_t stream,
                                 ProbsBy probs_by) const {
  QueryArgs q = q_in;
  deferred_probs_ = DeferredProbs{};
  spanned_probs_ = SpannedProbs{};
  const bool capture = capturing();
  const std::size_t BH = batch_ * heads_, vectors = static_cast<std::size_t>(q.S) * static_cast<std::size_t>(q.G);
  if (probs) {
    const std::size_t spanned = static_cast<std::size_t>(q.rows_total);
    if (capture && (logits_.bytes() < BH * vectors * spanned * sizeof(float) ||
                    final_ml_.bytes() < BH * vectors * 2 * sizeof(float))) {
      reject(method_, "attend: the captured step needs more logits workspace than graph_begin reserved (StepGraph)");
    }
    logits_.reserve(BH * vectors * spanned * sizeof(float));
    final_ml_.reserve(BH * vectors * 2 * sizeof(float));
    q.logits = logits_.as<float>();
  }
  Partials parts;
  const int n_parts = launch_segments(q, parts, true, stream);
  const std::size_t slots = static_cast<std::size_t>(std::max(n_parts, 1)) * q.tiles() * BH * kTileRows;
  if (capture && (parts_acc_.bytes() < slots * dim_ * sizeof(float) || parts_ml_.bytes() < slots * 2 * sizeof(float))) {
    reject(method_, "attend: the captured step needs more attention workspace than graph_begin reserved (StepGraph)");
  }
  parts_acc_.reserve(slots * dim_ * sizeof(float));
  parts_ml_.reserve(slots * 2 * sizeof(float));
  parts.acc = parts_acc_.as<float>();
  parts.ml = parts_ml_.as<float>();
  parts.parts = n_parts;
  // The segments merge their own partials (fused_merge: one launch fewer). A call without parts (no
  // rows) has no CTA to merge: combine_kernel writes its zeros.
  const bool fused = n_parts > 0 && fused_merge();
  if (fused) {
    const std::size_t counters = static_cast<std::size_t>(q.tiles()) * BH * sizeof(unsigned);
    if (capture && merge_arrivals_.bytes() < counters) {
      reject(method_, "attend: the captured step needs more merge counters than graph_begin reserved (StepGraph)");
    }
    merge_arrivals_.reserve(counters, stream);  // zero-filled when new, on the stream the kernels run on
    parts.arrivals = merge_arrivals_.as<unsigned>();
    parts.out = out;
    parts.final_ml = probs ? final_ml_.as<float>() : nullptr;
  }
  launch_segments(q, parts, false, stream);
  if (!fused) launch_combine(q, parts, n_parts, out, probs ? final_ml_.as<float>() : nullptr, stream);
  if (probs && probs_by != ProbsBy::attend) {
    deferred_probs_ = DeferredProbs{probs, probs_by == ProbsBy::observation, q, final_ml_.as<float>()};
  } else if (probs && (q.rows_total != static_cast<long long>(rows()) || orders_probs())) {
    // Probabilities over the rows the kernels span, then in row order.
    const std::size_t spanned_bytes = BH * static_cast<std::size_t>(q.S) * static_cast<std::size_t>(q.rows_total) * sizeof(float);
    if (capture && probs_spanned_.bytes() < spanned_bytes) {
      reject(method_, "attend: the captured step needs more probability workspace than graph_begin reserved (StepGraph)");
    }
    probs_spanned_.reserve(spanned_bytes);
    launch_probs(q, final_ml_.as<float>(), probs_spanned_.as<float>(), stream);
    order_probs(probs_spanned_.as<float>(), probs, q.S, stream);
    spanned_probs_ = SpannedProbs{probs, probs_spanned_.as<float>(), q.rows_total};
  } else if (probs) {
    launch_probs(q, final_ml_.as<float>(), probs, stream);
  }
}

DeviceCache::DeferredProbs DeviceCache::take_deferred_probs() const {
  const DeferredProbs d = deferred_probs_;
  deferred_probs_ = DeferredProbs{};
  return d;
}

void DeviceCache::fill_probs(const DeferredProbs& d, cudaStream_t stream) const {
  if (d.probs == nullptr) return;
  if (d.query.rows_total == static_cast<long long>(rows()) && !orders_probs()) {
    launch_probs(d.query, d.final_ml, d.probs, stream);
    return;
  }
  // A store whose kernels span other rows than its slots (eviction over codes): over the spanned
  // rows first, then into slot order, as attend does.
  const std::size_t bytes = batch_ * heads_ * static_cast<std::size_t>(d.query.S) *
                            static_cast<std::size_t>(d.query.rows_total) * sizeof(float);
  if (capturing() && probs_spanned_.bytes() < bytes) {
    reject(method_, "attend: the captured step needs more probability workspace than graph_begin reserved (StepGraph)");
  }
  probs_spanned_.reserve(bytes);
  launch_probs(d.query, d.final_ml, probs_spanned_.as<float>(), stream);
  order_probs(probs_spanned_.as<float>(), d.probs, d.query.S, stream);
  spanned_probs_ = SpannedProbs{d.probs, probs_spanned_.as<float>(), d.query.rows_total};
}

// ---------------------------------------------------------------------------------------------
// Replayed decode steps (StepGraph)

bool DeviceCache::capturing() const { return step_ != nullptr && step_->capturing; }

LaunchSlots& DeviceCache::graph_slots() {
  if (!step_) throw InputError(method_ + " cache (cuda): no captured step");
  return step_->slots;
}

void DeviceCache::graph_begin(int query_heads, int query_tokens) {
  DeviceGuard guard(device_);
  check_pending_error(false);
  if (batch_ == 0) {
    reject(method_, "StepGraph: capture a decode step after the prompt (the cache is empty, its shape unknown)");
  }
  if (query_heads % static_cast<int>(heads_) != 0) {
    reject(method_, "StepGraph: " + std::to_string(query_heads) + " query heads for " + std::to_string(heads_) +
                        " KV heads (a multiple is needed)");
  }
  graph_check_capturable();
  graph_reserve_step();
  step_ = std::make_unique<StepRecord>();
  QueryArgs q;
  q.B = static_cast<int>(batch_);
  q.S = query_tokens;
  q.Hq = query_heads;
  q.Hkv = static_cast<int>(heads_);
  q.G = q.Hq / q.Hkv;
  q.D = static_cast<int>(dim_);
  const std::size_t BH = batch_ * heads_;
  const std::size_t slots =
      static_cast<std::size_t>(std::max(parts_at_capacity(q), 1)) * q.tiles() * BH * kTileRows;
  parts_acc_.reserve(slots * dim_ * sizeof(float));
  parts_ml_.reserve(slots * 2 * sizeof(float));
  merge_arrivals_.reserve(static_cast<std::size_t>(q.tiles()) * BH * sizeof(unsigned), stream_);
  reserve_step_workspace(q.S, q.G);
  step_->capturing = true;
}

void DeviceCache::reserve_step_workspace(int query_tokens, int query_groups) {
  if (!graph_observes()) return;
  // The step's probabilities over the rows after its append: rows() + query_tokens, spanned by the
  // kernels over at most attention_rows_capacity() (a store with gaps).
  const std::size_t BH = batch_ * heads_, S = static_cast<std::size_t>(query_tokens);
  const std::size_t vectors = S * static_cast<std::size_t>(query_groups);
  const std::size_t span =
      std::max(rows() + S, static_cast<std::size_t>(std::max(attention_rows_capacity(), attention_rows() + static_cast<long long>(S))));
  logits_.reserve(BH * vectors * span * sizeof(float));
  final_ml_.reserve(BH * vectors * 2 * sizeof(float));
}

void DeviceCache::graph_captured() {
  if (!step_) throw InputError(method_ + " cache (cuda): StepGraph: end_capture without begin_capture");
  step_->capturing = false;
  if (!step_->appended || !step_->attended) {
    reject(method_, std::string("StepGraph: the captured step ") + (step_->appended ? "did not attend" : "did not append") +
                        " through this cache (every cache appends and attends once per step)");
  }
  if (graph_observes() && (!step_->probs || !step_->observed)) {
    reject(method_, "StepGraph: the captured step did not attend with probabilities and observe them (this cache is "
                    "scored by the attention it is shown, every step)");
  }
}

void DeviceCache::graph_arm(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!step_ || !step_->attended) reject(method_, "StepGraph: no captured step");
  if (batch_ == 0) reject(method_, "StepGraph: the cache was reset after the step was captured; capture again");
  check_pending_error(false);
  AppendInput in = step_->append;
  const int S = in.S;
  std::vector<std::int64_t> positions(static_cast<std::size_t>(S));
  for (int i = 0; i < S; ++i) positions[i] = next_position_ + i;
  in.first_position = positions[0];
  in.positions = nullptr;
  stream_ = stream;
  graph_between_steps(stream);  // on the stream, ahead of this step's replay
  reserve_step_workspace(S, static_cast<int>(step_->queries.heads / heads_));
  LaunchScope scope(step_->slots, LaunchSlots::Mode::update, exec);
  const ScopedFlag arming(arming_);
  absorb_step(in, positions, stream);
  QueryBlock queries = step_->queries;
  queries.stream = stream;
  const QueryArgs q = query_args(queries, positions);
  const long long probs_rows = orders_probs() ? static_cast<long long>(rows()) : q.rows_total;
  if (step_->probs && probs_rows != step_->probs_rows) {
    reject(method_, "StepGraph: the step attends over " + std::to_string(probs_rows) + " rows, the captured one over " +
                        std::to_string(step_->probs_rows) + " (its probabilities' shape); capture again");
  }
  attend_checked(q, step_->out, step_->probs, stream, probs_by(step_->probs, q.S, true, step_->probs_unread));
  if (step_->observed) {
    AttentionObservation obs = step_->observation;
    obs.query_positions = positions;
    obs.stream = stream;
    graph_observe(obs);
  }
  if (scope.visited() != step_->slots.size()) {
    reject(method_, "StepGraph: this step launched " + std::to_string(scope.visited()) + " kernels, the captured one " +
                        std::to_string(step_->slots.size()) + "; capture again");
  }
}

void DeviceCache::graph_launched(cudaStream_t stream) { KVSLIM_CUDA_CHECK(cudaEventRecord(flag_event_, stream)); }

void DeviceCache::graph_end() { step_.reset(); }

CacheView DeviceCache::materialize() const {
  synchronize();
  const std::size_t N = rows(), BH = batch_ * heads_;
  if (N == 0 || BH == 0) return CacheView{};
  view_keys_.resize(BH * N * dim_);
  view_values_.resize(BH * N * dim_);
  view_positions_.resize(BH * N);
  for (std::size_t bh = 0; bh < BH; ++bh) {
    download_rows(bh, view_keys_.data() + bh * N * dim_, view_values_.data() + bh * N * dim_);
    head_positions(bh, view_positions_.data() + bh * N);
  }
  CacheView v;
  v.batch = batch_;
  v.heads = heads_;
  v.tokens = N;
  v.head_dim = dim_;
  v.head_stride = N;
  v.keys = view_keys_.data();
  v.values = view_values_.data();
  v.positions = view_positions_.data();
  return v;
}

void DeviceCache::head_positions(std::size_t, std::int64_t* out) const {
  std::copy(positions_.begin(), positions_.end(), out);
}

CacheStats DeviceCache::stats() const {
  synchronize();
  CacheStats st;
  st.method = method_;
  st.batch = batch_;
  st.heads = heads_;
  st.head_dim = dim_;
  st.tokens_seen = tokens_seen_;
  const std::size_t N = rows(), BH = batch_ * heads_;
  st.kept_per_head.assign(BH, N);
  st.tokens_kept = N;
  const std::size_t dev = device_bytes();
  st.resident_bytes = dev + host_bytes();
  st.view_bytes = parts_acc_.bytes() + parts_ml_.bytes() + merge_arrivals_.bytes() + final_ml_.bytes() + logits_.bytes() +
                  qpos_.bytes() + probs_spanned_.bytes() +
                  (view_keys_.capacity() + view_values_.capacity()) * sizeof(std::uint16_t);
  st.kept_fp16_bytes = 2 * BH * N * dim_ * 2;
  st.seen_fp16_bytes = static_cast<std::size_t>(tokens_seen_) * BH * dim_ * 2 * 2;
  st.compression_ratio = st.resident_bytes == 0 ? 1.0 : static_cast<double>(st.seen_fp16_bytes) / st.resident_bytes;
  st.figures.emplace_back("device_bytes", static_cast<double>(dev));
  st.figures.emplace_back("device", static_cast<double>(device_));
  add_figures(st);
  return st;
}

void DeviceCache::reset() {
  DeviceGuard guard(device_);
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  clear();
  batch_ = heads_ = dim_ = 0;
  tokens_seen_ = 0;
  next_position_ = 0;
  positions_.clear();
  positions_.shrink_to_fit();
  const int none = INT_MAX;
  KVSLIM_CUDA_CHECK(cudaMemcpy(bad_.get(), &none, sizeof(int), cudaMemcpyHostToDevice));
  *bad_host_ = INT_MAX;
  poisoned_ = false;
  poison_message_.clear();
}

// ---------------------------------------------------------------------------------------------
// full

void DeviceDenseCache::grow(std::size_t rows, cudaStream_t stream) {
  // Growth by an eighth (at least 256 rows): a long context's store holds at most ~12 % unused
  // rows (doubling held up to 2x a DynamicCache's bytes), and the copy each growth costs stays
  // amortised (one whole-store copy per 1/8 of the tokens).
  const std::size_t cap =
      round_up(std::max({rows, reserved_, capacity_ + std::max(capacity_ / 8, std::size_t{256})}), 16);
  const std::size_t BH = batch_ * heads_, D = dim_;
  DeviceBuffer k, v, pos;
  k.reserve(BH * cap * D * 2);
  v.reserve(BH * cap * D * 2);
  pos.reserve(cap * sizeof(std::int64_t));
  if (n_ > 0) {
    copy_head_rows(k.get(), cap, k_.get(), capacity_, n_, BH, D * 2, stream);
    copy_head_rows(v.get(), cap, v_.get(), capacity_, n_, BH, D * 2, stream);
    copy_head_rows(pos.get(), cap, pos_.get(), capacity_, n_, 1, sizeof(std::int64_t), stream);
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));  // before the old buffers go
  }
  k_ = std::move(k);
  v_ = std::move(v);
  pos_ = std::move(pos);
  capacity_ = cap;
}

void DeviceDenseCache::reserve(std::size_t tokens) {
  reserved_ = tokens;
  // Known shape: allocate now (a captured step cannot; StepGraph reserves before it captures).
  if (batch_ != 0 && tokens > capacity_) {
    DeviceGuard guard(device());
    grow(tokens, stream());
  }
}

int DeviceDenseCache::parts_at_capacity(const QueryArgs& q) const {
  return dense_splits(q, static_cast<int>(std::max(capacity_, n_ + 1)), sm_count_, type_);
}

void DeviceDenseCache::absorb(const AppendInput& in, const std::vector<std::int64_t>&, cudaStream_t stream) {
  if (n_ == 0) type_ = in.dtype == DType::bf16 ? DenseType::bf16 : DenseType::f16;
  if (n_ + in.S > capacity_) {
    if (capturing()) {
      reject(method(), "a captured step needs " + std::to_string(n_ + in.S) + " rows, " + std::to_string(capacity_) +
                           " are allocated: reserve() the run's tokens before StepGraph::begin_capture");
    }
    grow(n_ + in.S, stream);
  }
  launch_dense_append(in, k_.as<std::uint16_t>(), v_.as<std::uint16_t>(), type_, static_cast<long long>(capacity_),
                      static_cast<int>(n_), pos_.as<std::int64_t>(), stream);
  n_ += in.S;
}

int DeviceDenseCache::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only,
                                      cudaStream_t stream) const {
  const int splits = n_ > 0 ? dense_splits(q, static_cast<int>(n_), sm_count_, type_) : 0;
  if (!count_only) {
    DenseRows rows;
    rows.k = k_.as<std::uint16_t>();
    rows.v = v_.as<std::uint16_t>();
    rows.head_stride = static_cast<long long>(capacity_ * dim_);
    rows.pos = pos_.as<std::int64_t>();
    rows.n_rows = static_cast<int>(n_);
    rows.type = type_;
    launch_dense(q, rows, parts, 0, splits, stream);  // splits == 0: a switched-off launch (kernel_launch.h)
  }
  return splits;
}

void DeviceDenseCache::download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const {
  download_dense_head(k_.as<std::uint16_t>(), v_.as<std::uint16_t>(), type_, capacity_, dim_, bh, n_, keys, values);
}

void DeviceDenseCache::clear() {
  k_.release();
  v_.release();
  pos_.release();
  capacity_ = n_ = 0;
}

// ---------------------------------------------------------------------------------------------
// kivi

DeviceKiviCache::DeviceKiviCache(int device, int key_bits, int value_bits, int group_rows, int staging)
    : DeviceCache("kivi", device), key_bits_(key_bits), value_bits_(value_bits), group_rows_(group_rows), staging_(staging) {}

std::size_t DeviceKiviCache::device_bytes() const {
  std::size_t b = k_codes_.bytes() + v_codes_.bytes() + k_params_.bytes() + v_params_.bytes() + pos_.bytes();
  for (int i = 0; i < 2; ++i) b += stage_k_[i].bytes() + stage_v_[i].bytes() + stage_pos_[i].bytes();
  return b;
}

void DeviceKiviCache::reserve(std::size_t tokens) {
  reserved_tokens_ = tokens;
  // Known shape: allocate the units now (a captured step cannot; see DeviceDenseCache::reserve).
  const std::size_t units = tokens / 32;
  if (batch_ != 0 && k_row_bytes_ != 0 && units > unit_capacity_) {
    DeviceGuard guard(device());
    grow_codes(units, stream());
  }
}

PackedRows DeviceKiviCache::packed_rows(int units) const {
  PackedRows rows;
  rows.k_codes = k_codes_.as<std::uint8_t>();
  rows.v_codes = v_codes_.as<std::uint8_t>();
  rows.k_params = k_params_.as<std::uint16_t>();
  rows.v_params = v_params_.as<std::uint16_t>();
  rows.k_codes_stride = static_cast<long long>(unit_capacity_ * 32 * k_row_bytes_);
  rows.v_codes_stride = static_cast<long long>(unit_capacity_ * 32 * v_row_bytes_);
  rows.params_stride = static_cast<long long>(unit_capacity_ / group_units() * 2 * dim_);
  rows.pos = pos_.as<std::int64_t>();
  rows.n_units = units;
  rows.group_units = group_units();
  rows.k_bits = key_bits_;
  rows.v_bits = value_bits_;
  return rows;
}

int DeviceKiviCache::parts_at_capacity(const QueryArgs& q) const {
  // The most units the store can hold before it grows (whole groups).
  const std::size_t units = std::max(unit_capacity_, static_cast<std::size_t>(units_ + group_units()));
  return packed_splits(q, packed_rows(static_cast<int>(units)), sm_count_) +
         dense_splits(q, staging_, sm_count_, DenseType::f16);
}

void DeviceKiviCache::grow_codes(std::size_t units, cudaStream_t stream) {
  // By an eighth (at least 8 units), as the dense store grows; whole groups.
  const std::size_t GU = static_cast<std::size_t>(group_units());
  std::size_t cap = std::max({units, reserved_tokens_ / 32, unit_capacity_ + std::max(unit_capacity_ / 8, std::size_t{8})});
  cap = (cap + GU - 1) / GU * GU;
  const std::size_t BH = batch_ * heads_, D = dim_;
  const std::size_t KRB = static_cast<std::size_t>(k_row_bytes_), VRB = static_cast<std::size_t>(v_row_bytes_);
  DeviceBuffer kc, vc, kp, vp, pos;
  kc.reserve(BH * cap * 32 * KRB);
  vc.reserve(BH * cap * 32 * VRB);
  kp.reserve(BH * (cap / GU) * 2 * D * 2);
  vp.reserve(BH * (cap / GU) * 2 * D * 2);
  pos.reserve(cap * 32 * sizeof(std::int64_t));
  if (units_ > 0) {
    const std::size_t u = static_cast<std::size_t>(units_), old_groups = unit_capacity_ / GU, groups = u / GU;
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(kc.get(), cap * 32 * KRB, k_codes_.get(), unit_capacity_ * 32 * KRB, u * 32 * KRB,
                                        BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(vc.get(), cap * 32 * VRB, v_codes_.get(), unit_capacity_ * 32 * VRB, u * 32 * VRB,
                                        BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(kp.get(), (cap / GU) * 4 * D, k_params_.get(), old_groups * 4 * D, groups * 4 * D,
                                        BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(vp.get(), (cap / GU) * 4 * D, v_params_.get(), old_groups * 4 * D, groups * 4 * D,
                                        BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(pos.get(), pos_.get(), u * 32 * sizeof(std::int64_t), cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  k_codes_ = std::move(kc);
  v_codes_ = std::move(vc);
  k_params_ = std::move(kp);
  v_params_ = std::move(vp);
  pos_ = std::move(pos);
  unit_capacity_ = cap;
}

void DeviceKiviCache::absorb(const AppendInput& in, const std::vector<std::int64_t>&, cudaStream_t stream) {
  const std::size_t BH = batch_ * heads_, D = dim_;
  if (k_row_bytes_ == 0) {
    k_row_bytes_ = static_cast<int>(D) * key_bits_ / 8;
    v_row_bytes_ = static_cast<int>(D) * value_bits_ / 8;
    for (int i = 0; i < 2; ++i) {
      stage_k_[i].reserve(BH * staging_ * D * 2);
      stage_v_[i].reserve(BH * staging_ * D * 2);
      stage_pos_[i].reserve(staging_ * sizeof(std::int64_t));
    }
  }
  const int total = staged_ + in.S;
  const int compress = total >= staging_ ? total / group_rows_ * group_rows_ : 0;
  if (compress > 0 && static_cast<std::size_t>(units_ + compress / 32) > unit_capacity_) {
    if (capturing()) {
      reject(method(), "a captured step needs " + std::to_string(units_ + compress / 32) + " units of 32 rows, " +
                           std::to_string(unit_capacity_) +
                           " are allocated: reserve() the run's tokens before StepGraph::begin_capture");
    }
    grow_codes(static_cast<std::size_t>(units_ + compress / 32), stream);
  }
  KiviStore store;
  store.k_codes = k_codes_.as<std::uint8_t>();
  store.v_codes = v_codes_.as<std::uint8_t>();
  store.k_params = k_params_.as<std::uint16_t>();
  store.v_params = v_params_.as<std::uint16_t>();
  store.pos = pos_.as<std::int64_t>();
  store.capacity = static_cast<long long>(unit_capacity_ * 32);
  store.k_bits = key_bits_;
  store.v_bits = value_bits_;
  store.group_rows = group_rows_;
  const int out = compress > 0 ? 1 - cur_ : cur_;
  StagingWindow w;
  w.k_in = stage_k_[cur_].as<std::uint16_t>();
  w.v_in = stage_v_[cur_].as<std::uint16_t>();
  w.pos_in = stage_pos_[cur_].as<std::int64_t>();
  w.k_out = stage_k_[out].as<std::uint16_t>();
  w.v_out = stage_v_[out].as<std::uint16_t>();
  w.pos_out = stage_pos_[out].as<std::int64_t>();
  w.capacity = staging_;
  w.staged = staged_;
  launch_kivi_append(in, store, units_, compress, w, stream);
  cur_ = out;
  units_ += compress / 32;
  staged_ = total - compress;
}

int DeviceKiviCache::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only,
                                     cudaStream_t stream) const {
  return launch_codes_and_window(q, packed_rows(units_),
                                 staging_window_rows(stage_k_[cur_].as<std::uint16_t>(),
                                                     stage_v_[cur_].as<std::uint16_t>(),
                                                     stage_pos_[cur_].as<std::int64_t>(), staging_,
                                                     static_cast<int>(dim_), staged_, units_ * 32),
                                 parts, count_only, sm_count_, stream);
}

DeviceKiviCache::Snapshot DeviceKiviCache::snapshot() const {
  synchronize();
  Snapshot s;
  s.units = units_;
  s.staged = staged_;
  s.k_row_bytes = k_row_bytes_;
  s.v_row_bytes = v_row_bytes_;
  s.group_rows = group_rows_;
  const std::size_t BH = batch_ * heads_, D = dim_, U = static_cast<std::size_t>(units_);
  const std::size_t KRB = static_cast<std::size_t>(k_row_bytes_), VRB = static_cast<std::size_t>(v_row_bytes_);
  const std::size_t GU = static_cast<std::size_t>(group_units()), groups = U / GU, group_capacity = unit_capacity_ / GU;
  for (auto* v : {&s.k_codes, &s.v_codes}) v->resize(BH);
  for (auto* v : {&s.k_params, &s.v_params, &s.stage_k, &s.stage_v}) v->resize(BH);
  for (std::size_t bh = 0; bh < BH; ++bh) {
    s.k_codes[bh].resize(U * 32 * KRB);
    s.v_codes[bh].resize(U * 32 * VRB);
    s.k_params[bh].resize(groups * 2 * D);
    s.v_params[bh].resize(groups * 2 * D);
    s.stage_k[bh].resize(staged_ * D);
    s.stage_v[bh].resize(staged_ * D);
    if (U > 0) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.k_codes[bh].data(), k_codes_.as<std::uint8_t>() + bh * unit_capacity_ * 32 * KRB,
                                   U * 32 * KRB, cudaMemcpyDeviceToHost));
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.v_codes[bh].data(), v_codes_.as<std::uint8_t>() + bh * unit_capacity_ * 32 * VRB,
                                   U * 32 * VRB, cudaMemcpyDeviceToHost));
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.k_params[bh].data(), k_params_.as<std::uint16_t>() + bh * group_capacity * 2 * D,
                                   groups * 4 * D, cudaMemcpyDeviceToHost));
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.v_params[bh].data(), v_params_.as<std::uint16_t>() + bh * group_capacity * 2 * D,
                                   groups * 4 * D, cudaMemcpyDeviceToHost));
    }
    if (staged_ > 0) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.stage_k[bh].data(), stage_k_[cur_].as<std::uint16_t>() + bh * staging_ * D,
                                   staged_ * D * 2, cudaMemcpyDeviceToHost));
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.stage_v[bh].data(), stage_v_[cur_].as<std::uint16_t>() + bh * staging_ * D,
                                   staged_ * D * 2, cudaMemcpyDeviceToHost));
    }
  }
  return s;
}

void DeviceKiviCache::download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const {
  const std::size_t D = dim_, GR = static_cast<std::size_t>(group_rows_), U = static_cast<std::size_t>(units_);
  const std::size_t GU = static_cast<std::size_t>(group_units()), groups = U / GU, group_capacity = unit_capacity_ / GU;
  const std::size_t KRB = static_cast<std::size_t>(k_row_bytes_), VRB = static_cast<std::size_t>(v_row_bytes_);
  std::vector<std::uint8_t> kc(U * 32 * KRB), vc(U * 32 * VRB);
  std::vector<std::uint16_t> kp(groups * 2 * D), vp(groups * 2 * D);
  if (U > 0) {
    KVSLIM_CUDA_CHECK(cudaMemcpy(kc.data(), k_codes_.as<std::uint8_t>() + bh * unit_capacity_ * 32 * KRB, kc.size(),
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(vc.data(), v_codes_.as<std::uint8_t>() + bh * unit_capacity_ * 32 * VRB, vc.size(),
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(kp.data(), k_params_.as<std::uint16_t>() + bh * group_capacity * 2 * D, kp.size() * 2,
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(vp.data(), v_params_.as<std::uint16_t>() + bh * group_capacity * 2 * D, vp.size() * 2,
                                 cudaMemcpyDeviceToHost));
  }
  const auto& k = quant::simd_kernels();
  std::vector<float> scale(D), zero(D);
  std::vector<std::uint16_t*> out_rows(GR);
  for (std::size_t g = 0; g < groups; ++g) {
    for (int which = 0; which < 2; ++which) {
      const std::uint16_t* p = (which ? vp : kp).data() + g * 2 * D;
      k.params_to_f32(p, p + D, D, scale.data(), zero.data());
      std::uint16_t* dst = (which ? values : keys) + g * GR * D;
      for (std::size_t r = 0; r < GR; ++r) out_rows[r] = dst + r * D;
      const std::size_t RB = which ? VRB : KRB;
      k.decode_rows_f16((which ? vc : kc).data() + g * GR * RB, GR, D, scale.data(), zero.data(),
                        which ? value_bits_ : key_bits_, out_rows.data());
    }
  }
  if (staged_ > 0) {
    KVSLIM_CUDA_CHECK(cudaMemcpy(keys + U * 32 * D, stage_k_[cur_].as<std::uint16_t>() + bh * staging_ * D,
                                 staged_ * D * 2, cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(values + U * 32 * D, stage_v_[cur_].as<std::uint16_t>() + bh * staging_ * D,
                                 staged_ * D * 2, cudaMemcpyDeviceToHost));
  }
}

void DeviceKiviCache::clear() {
  k_codes_.release();
  v_codes_.release();
  k_params_.release();
  v_params_.release();
  pos_.release();
  for (int i = 0; i < 2; ++i) {
    stage_k_[i].release();
    stage_v_[i].release();
    stage_pos_[i].release();
  }
  cur_ = 0;
  unit_capacity_ = 0;
  units_ = staged_ = 0;
  k_row_bytes_ = v_row_bytes_ = 0;
}

void DeviceKiviCache::add_figures(CacheStats& st) const {
  st.figures.emplace_back("kivi_key_bits", key_bits_);
  st.figures.emplace_back("kivi_value_bits", value_bits_);
  st.figures.emplace_back("kivi_group_size", group_rows_);
  st.figures.emplace_back("staging_tokens", staged_);
  st.figures.emplace_back("compressed_groups", units_ * 32 / group_rows_);
}

// ---------------------------------------------------------------------------------------------
// kvslim/cuda.h

bool built() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_description(int device) {
  cudaDeviceProp p{};
  KVSLIM_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 20) +
         " MiB, L2 " + std::to_string(p.l2CacheSize >> 20) + " MiB, runtime " + std::to_string(runtime / 1000) + "." +
         std::to_string(runtime % 1000 / 10) + ", driver " + std::to_string(driver / 1000) + "." +
         std::to_string(driver % 1000 / 10);
}

namespace {
// The rows of an eviction method on the device (KVCacheConfig::storage): null for fp16 slots, or
// kivi or zipcache codes (validate() applied the device rules to their fields).
std::unique_ptr<DeviceRowStore> device_store(const KVCacheConfig& c) {
  if (c.storage != "kivi" && c.storage != "zipcache") return nullptr;
  PackedLayout l;
  l.with_exposure = c.method != "streaming" &&
                    make_eviction_policy(c, c.*method_info(c.method).n_sink).scoring == Scoring::attention_normalized;
  if (c.storage == "kivi") {
    l.sets = 1;
    l.key_bits[0] = l.key_bits[1] = c.kivi_keys_at();
    l.value_bits = c.kivi_values_at();
    l.group_rows = c.kivi_group_size;
    l.staging = c.kivi_staging;
  } else {  // the CPU's make_storage: salient keys at hi_bits, the rest at lo_bits, values at value_bits (-1: hi_bits)
    l.sets = 2;
    l.key_bits[0] = c.zipcache_hi_bits;
    l.key_bits[1] = c.zipcache_lo_bits;
    l.value_bits = c.zipcache_value_bits == -1 ? c.zipcache_hi_bits : c.zipcache_value_bits;
    l.hi_fraction = c.zipcache_hi_fraction;
    l.group_rows = c.zipcache_group_size;
    l.staging = c.zipcache_staging;
  }
  return std::make_unique<DevicePackedRows>(l);
}
}  // namespace

std::unique_ptr<KVCache> make_cache(const KVCacheConfig& c, int layer_budget, std::shared_ptr<SqueezeCoordinator> coordinator,
                                    int layer_id) {
  const int device = c.device_index();
  if (device < 0) throw ConfigError("KVCacheConfig.device = \"" + c.device + "\": not a CUDA device");
  const int n = device_count();
  if (device >= n) {
    throw ConfigError("KVCacheConfig.device = \"" + c.device + "\": this process sees " + std::to_string(n) +
                      " CUDA device(s)");
  }
  // validate() has checked that the registry marks the method `cuda` (config.cc): full (dense),
  // streaming, h2o, squeeze and pyramidkv (the eviction core over device slots or kivi codes),
  // zipcache and kivi (the quantizers' device storages).
  const MethodInfo& info = method_info(c.method);
  if (info.kind == MethodKind::dense) return std::make_unique<DeviceDenseCache>(device);
  if (c.method == "streaming") {
    return std::make_unique<DeviceEvictionCache>(c.method, make_streaming_policy(c), static_cast<std::size_t>(c.streaming_budget),
                                                 device, nullptr, device_store(c));
  }
  if (info.kind == MethodKind::eviction && info.cuda) {
    const EvictionPolicy policy = make_eviction_policy(c, c.*info.n_sink);
    if (!scores_by_attention(policy.scoring)) {
      throw ConfigError("KVCacheConfig.evict_scoring / evict_profile: " + c.method +
                        " on a CUDA device is scored by the attention its caller observes (evict_profile = "
                        "query_aware, or evict_scoring = attention / attention_normalized); the key proxy of "
                        "evict_profile = original reads stored keys on the host");
    }
    if (policy.row_weight != nullptr) {
      throw ConfigError("KVCacheConfig.evict_scoring = \"" + c.evict_scoring +
                        "\": a registered row score reads each row's key and value on the host; not on a CUDA device");
    }
    if (c.method == "squeeze") {
      if (c.squeeze_signal == "hidden_cosine") {
        throw ConfigError("KVCacheConfig.squeeze_signal = \"hidden_cosine\": the hidden states are read on the host; on a "
                          "CUDA device squeeze takes key_dispersion (default), attention_entropy, attention_coverage or "
                          "global_topk");
      }
      // The host SqueezeCache's budget and schedule (cache/squeeze_schedule.h).
      const int budget = c.squeeze_resolved_budget.value_or(c.squeeze_budget);
      return std::make_unique<DeviceEvictionCache>(c.method, policy, static_cast<std::size_t>(budget), device,
                                                   std::make_unique<SqueezeSchedule>(c, std::move(coordinator), layer_id),
                                                   device_store(c));
    }
    const int budget = layer_budget >= 0 ? layer_budget : c.*info.budget;
    return std::make_unique<DeviceEvictionCache>(c.method, policy, static_cast<std::size_t>(budget), device, nullptr,
                                                 device_store(c));
  }
  if (c.method == "zipcache") {
    // Widths, group size, window and saliency were checked by KVCacheConfig::validate() (device rules).
    const int value_bits = c.zipcache_value_bits == -1 ? c.zipcache_hi_bits : c.zipcache_value_bits;
    return std::make_unique<DeviceZipCache>(device, c.zipcache_hi_bits, c.zipcache_lo_bits, value_bits,
                                            c.zipcache_hi_fraction, c.zipcache_group_size, c.zipcache_staging);
  }
  if (info.kind == MethodKind::quantizer && info.cuda) {
    // Widths, group size and window were checked by KVCacheConfig::validate() (device rules).
    return std::make_unique<DeviceKiviCache>(device, c.kivi_keys_at(), c.kivi_values_at(), c.kivi_group_size,
                                             c.kivi_staging);
  }
  throw ConfigError("KVCacheConfig.method = \"" + c.method + "\" has no CUDA storage yet (device \"" + c.device + "\")");
}

}  // namespace kvslim::cuda
