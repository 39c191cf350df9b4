#include "cuda/device_eviction_cache.h"

#include <algorithm>
#include <stdexcept>

#include "cuda/append.h"
#include "cuda/attend.h"
#include "kvslim/errors.h"

namespace kvslim::cuda {
namespace {

std::size_t round_up16(std::size_t x) { return (x + 15) / 16 * 16; }

// One CTA per move (head, from, to): the row's key, value and position into slot `to`.
// Rows are D fp16/bf16 values (D = 64 or 128: 128 or 256 bytes, 16-byte aligned).
__global__ void apply_moves_kernel(const int* moves, std::uint16_t* k, std::uint16_t* v, std::int64_t* pos,
                                   long long stride, int D) {
  const int* m = moves + 3 * blockIdx.x;
  const long long src = m[0] * stride + m[1], dst = m[0] * stride + m[2];
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

void DeviceSlots::relayout(std::size_t capacity, std::size_t keep) {
  flush();
  const std::size_t stride = round_up16(std::max<std::size_t>(capacity, 1));
  const std::size_t H = heads_total_, D = dim_;
  DeviceBuffer k, v, pos;
  k.reserve(H * stride * D * 2);
  v.reserve(H * stride * D * 2);
  pos.reserve(H * stride * sizeof(std::int64_t));
  copy_head_rows(k.get(), stride, k_.get(), stride_, keep, H, D * 2, stream_);
  copy_head_rows(v.get(), stride, v_.get(), stride_, keep, H, D * 2, stream_);
  copy_head_rows(pos.get(), stride, pos_.get(), stride_, keep, H, sizeof(std::int64_t), stream_);
  if (keep > 0) KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the old store goes
  k_ = std::move(k);
  v_ = std::move(v);
  pos_ = std::move(pos);
  stride_ = stride;
}

void DeviceSlots::write(std::size_t, std::size_t, const std::uint16_t*, const std::uint16_t*) {
  not_on_device("rows reach the device slots through the append kernel, never one by one from the host");
}

void DeviceSlots::move(std::size_t head, std::size_t from, std::size_t to) {
  const std::uint64_t f = head * stride_ + from, t = head * stride_ + to;
  if (pending_to_.count(f) != 0 || pending_to_.count(t) != 0 || pending_from_.count(t) != 0) flush();
  moves_.insert(moves_.end(), {static_cast<int>(head), static_cast<int>(from), static_cast<int>(to)});
  pending_from_.insert(f);
  pending_to_.insert(t);
}

void DeviceSlots::flush() {
  if (moves_.empty()) return;
  const std::size_t bytes = moves_.size() * sizeof(int);
  if (moves_dev_.bytes() < bytes) moves_dev_.reserve(bytes);
  // From pageable memory: the call returns once moves_ is staged, so it may be reused at once.
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(moves_dev_.get(), moves_.data(), bytes, cudaMemcpyHostToDevice, stream_));
  const unsigned n = static_cast<unsigned>(moves_.size() / 3);
  apply_moves_kernel<<<n, 32, 0, stream_>>>(moves_dev_.as<int>(), keys(), values(), positions(),
                                            static_cast<long long>(stride_), static_cast<int>(dim_));
  KVSLIM_CUDA_LAUNCHED("apply_moves_kernel");
  moves_.clear();
  pending_from_.clear();
  pending_to_.clear();
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
  moves_dev_.release();
  moves_.clear();
  pending_from_.clear();
  pending_to_.clear();
  heads_total_ = dim_ = stride_ = 0;
  type_ = DenseType::f16;
}

// ---------------------------------------------------------------------------------------------
// DeviceEvictionCache

DeviceEvictionCache::DeviceEvictionCache(std::string method, EvictionPolicy policy, std::size_t budget, int device)
    : DeviceCache(std::move(method), device),
      slots_(new DeviceSlots),
      core_(policy, std::unique_ptr<RowStorage>(slots_)),
      budget_(budget) {
  mirror_positions_ = false;
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
  const std::size_t n0 = core_.rows();
  if (n0 == 0) slots_->set_type(in.dtype == DType::bf16 ? DenseType::bf16 : DenseType::f16);
  slots_->set_stream(stream);
  core_.absorb_placed(batch_, heads_, dim_, positions.data(), static_cast<std::size_t>(in.S), budget_);
  launch_dense_append(in, slots_->keys(), slots_->values(), slots_->type(), static_cast<long long>(slots_->stride()),
                      static_cast<int>(n0), slots_->positions(), stream, /*pos_per_head=*/true);
}

void DeviceEvictionCache::observe_attention(const AttentionObservation& obs) {
  if (!needs().attention) return;
  DeviceGuard guard(device());
  raise_pending_error();
  const std::string who = std::string(method()) + " cache (cuda)";
  AttentionObservation host = obs;
  const auto stream = static_cast<cudaStream_t>(obs.stream);
  if (obs.space == MemorySpace::cuda) {
    if (obs.probs == nullptr || obs.batch != batch_ || obs.heads != heads_ || obs.tokens != core_.rows() ||
        obs.stride < obs.tokens) {
      throw InputError(who + ": attention observation [" + std::to_string(obs.batch) + ", " + std::to_string(obs.heads) +
                       ", " + std::to_string(obs.queries) + ", " + std::to_string(obs.tokens) + "] does not match [" +
                       std::to_string(batch_) + ", " + std::to_string(heads_) + ", q, " + std::to_string(core_.rows()) +
                       "] (the rows after the last append)");
    }
    check_device_pointer(method(), obs.probs, device(), "probs");
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
  }
  slots_->set_stream(stream);
  core_.observe(host, budget_, who);
  slots_->flush();
}

int DeviceEvictionCache::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only,
                                         cudaStream_t stream) const {
  const int n = static_cast<int>(core_.rows());
  const int splits = dense_splits(q, n, sm_count_, slots_->type());
  if (!count_only) {
    DenseRows rows;
    rows.k = slots_->keys();
    rows.v = slots_->values();
    rows.head_stride = static_cast<long long>(slots_->stride() * dim_);
    rows.pos = slots_->positions();
    rows.pos_head_stride = static_cast<long long>(slots_->stride());
    rows.n_rows = n;
    rows.type = slots_->type();
    launch_dense(q, rows, parts, 0, splits, stream);
  }
  return splits;
}

void DeviceEvictionCache::download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const {
  download_dense_head(slots_->keys(), slots_->values(), slots_->type(), slots_->stride(), dim_, bh, core_.rows(), keys,
                      values);
}

void DeviceEvictionCache::head_positions(std::size_t bh, std::int64_t* out) const {
  std::copy_n(core_.positions(bh), core_.rows(), out);
}

std::size_t DeviceEvictionCache::host_bytes() const {
  return core_.resident_bytes() - slots_->resident_bytes() + probs_host_floats_ * sizeof(float);
}

void DeviceEvictionCache::clear() { core_.reset(); }

void DeviceEvictionCache::add_figures(CacheStats& st) const {
  st.figures.emplace_back("layer_budget", static_cast<double>(budget_));
}

}  // namespace kvslim::cuda
