#include "cuda/device_zip_cache.h"

#include <algorithm>
#include <string>

#include "cuda/step_graph.h"
#include "kvslim/errors.h"
#include "kvslim/zipcache.h"
#include "quant/quant_kernels.h"

namespace kvslim::cuda {

namespace {
std::size_t round32(std::size_t x) { return (x + 31) / 32 * 32; }
std::size_t units_for(int rows) { return (static_cast<std::size_t>(rows) + 31) / 32; }
}  // namespace

DeviceZipCache::DeviceZipCache(int device, int hi_bits, int lo_bits, int value_bits, double hi_fraction, int group_rows,
                               int staging)
    : DeviceCache("zipcache", device), value_bits_(value_bits), group_rows_(group_rows), staging_(staging),
      hi_fraction_(hi_fraction) {
  hi_.k_bits = hi_bits;
  lo_.k_bits = lo_bits;
  hi_.v_bits = lo_.v_bits = value_bits;
}

std::size_t DeviceZipCache::device_bytes() const {
  return hi_.bytes() + lo_.bytes() + win_k_.bytes() + win_v_.bytes() + win_pos_.bytes() + mask_.bytes() + norms_.bytes() +
         salient_.bytes() + members_.bytes();
}

std::size_t DeviceZipCache::host_bytes() const {
  return DeviceCache::host_bytes() + blocks_.capacity() * sizeof(Block);
}

void DeviceZipCache::resize_window(std::size_t rows, cudaStream_t stream) {
  const std::size_t cap = round32(rows), BH = batch_ * heads_, D = dim_;
  if (cap == window_capacity_) return;
  DeviceBuffer k, v, pos;
  k.reserve(BH * cap * D * 2);
  v.reserve(BH * cap * D * 2);
  pos.reserve(cap * sizeof(std::int64_t));
  if (staged_ > 0) {
    const std::size_t n = static_cast<std::size_t>(staged_);
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(k.get(), cap * D * 2, win_k_.get(), window_capacity_ * D * 2, n * D * 2, BH,
                                        cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(v.get(), cap * D * 2, win_v_.get(), window_capacity_ * D * 2, n * D * 2, BH,
                                        cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(pos.get(), win_pos_.get(), n * sizeof(std::int64_t), cudaMemcpyDeviceToDevice, stream));
  }
  KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old window (and any kernel reading it) is done
  win_k_ = std::move(k);
  win_v_ = std::move(v);
  win_pos_ = std::move(pos);
  window_capacity_ = cap;
}

void DeviceZipCache::check_not_capturing(const std::string& what) const {
  if (capturing()) {
    reject(method(), "a captured step needs " + what + ": reserve() the run's tokens before StepGraph::begin_capture");
  }
}

void DeviceZipCache::grow_set(SetStore& s, std::size_t units, cudaStream_t stream) {
  if (units <= s.unit_capacity) return;
  check_not_capturing(std::to_string(units) + " units of 32 rows in a set, " + std::to_string(s.unit_capacity) +
                      " are allocated");
  // By an eighth (at least 8 units), as the other device stores grow.
  const std::size_t cap = std::max(units, s.unit_capacity + std::max(s.unit_capacity / 8, std::size_t{8}));
  const std::size_t BH = batch_ * heads_, D = dim_;
  const std::size_t KRB = D * static_cast<std::size_t>(s.k_bits) / 8, VRB = D * static_cast<std::size_t>(s.v_bits) / 8;
  DeviceBuffer kc, vc, kp, vp, pos, starts;
  kc.reserve(BH * cap * 32 * KRB);
  vc.reserve(BH * cap * 32 * VRB);
  kp.reserve(BH * cap * 2 * D * 2);
  vp.reserve(BH * cap * 2 * D * 2);
  pos.reserve(BH * cap * 32 * sizeof(std::int64_t));
  starts.reserve(cap);
  if (s.units > 0) {
    const std::size_t u = static_cast<std::size_t>(s.units), old = s.unit_capacity;
    const auto copy = [&](DeviceBuffer& dst, const DeviceBuffer& src, std::size_t per_unit) {
      KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(dst.get(), cap * per_unit, src.get(), old * per_unit, u * per_unit, BH,
                                          cudaMemcpyDeviceToDevice, stream));
    };
    copy(kc, s.k_codes, 32 * KRB);
    copy(vc, s.v_codes, 32 * VRB);
    copy(kp, s.k_params, 2 * D * 2);
    copy(vp, s.v_params, 2 * D * 2);
    copy(pos, s.pos, 32 * sizeof(std::int64_t));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(starts.get(), s.unit_starts.get(), u, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  s.k_codes = std::move(kc);
  s.v_codes = std::move(vc);
  s.k_params = std::move(kp);
  s.v_params = std::move(vp);
  s.pos = std::move(pos);
  s.unit_starts = std::move(starts);
  s.unit_capacity = cap;
}

ZipSet DeviceZipCache::zip_set(SetStore& s) const {
  ZipSet z;
  z.k_codes = s.k_codes.as<std::uint8_t>();
  z.v_codes = s.v_codes.as<std::uint8_t>();
  z.k_params = s.k_params.as<std::uint16_t>();
  z.v_params = s.v_params.as<std::uint16_t>();
  z.pos = s.pos.as<std::int64_t>();
  z.unit_starts = s.unit_starts.as<std::uint8_t>();
  z.capacity = static_cast<long long>(s.unit_capacity * 32);
  z.k_bits = s.k_bits;
  z.v_bits = s.v_bits;
  z.n_units = s.units;
  return z;
}

void DeviceZipCache::grow_mask(std::size_t words, cudaStream_t stream) {
  if (words <= mask_words_) return;
  check_not_capturing(std::to_string(words) + " words of saliency bits per head");
  const std::size_t BH = batch_ * heads_, cap = std::max(words, mask_words_ + mask_words_ / 2 + 64);
  DeviceBuffer grown;
  grown.reserve(BH * cap * 4);
  if (compressed_ > 0) {
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(grown.get(), cap * 4, mask_.get(), mask_words_ * 4,
                                        static_cast<std::size_t>(compressed_) / 32 * 4, BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  mask_ = std::move(grown);
  mask_words_ = cap;
}

void DeviceZipCache::reserve(std::size_t tokens) {
  if (batch_ == 0 || tokens <= rows()) return;  // the shape is known at the first append
  DeviceGuard guard(device());
  const cudaStream_t stream = this->stream();
  // Decode steps make a block each time the window fills (`staging` rows, whole groups).
  const std::size_t waiting = static_cast<std::size_t>(staged_) + (tokens - rows());
  const std::size_t blocks = waiting / static_cast<std::size_t>(staging_) + 1;
  const int m = staging_ / group_rows_ * group_rows_;
  const int n_hi = static_cast<int>(salient_count(static_cast<std::size_t>(m), hi_fraction_));
  grow_set(hi_, static_cast<std::size_t>(hi_.units) + blocks * units_for(n_hi), stream);
  grow_set(lo_, static_cast<std::size_t>(lo_.units) + blocks * units_for(m - n_hi), stream);
  grow_mask((static_cast<std::size_t>(compressed_) + waiting) / 32 + 1, stream);
  const std::size_t scratch = batch_ * heads_ * static_cast<std::size_t>(m);
  norms_.reserve(scratch * sizeof(double));
  salient_.reserve(scratch);
  members_.reserve(scratch * sizeof(int));
}

int DeviceZipCache::parts_at_capacity(const QueryArgs& q) const {
  PackedRows hi = packed(hi_), lo = packed(lo_);
  hi.n_units = static_cast<int>(std::max<std::size_t>(hi_.unit_capacity, 1));
  lo.n_units = static_cast<int>(std::max<std::size_t>(lo_.unit_capacity, 1));
  return packed_splits(q, hi, sm_count_) + packed_splits(q, lo, sm_count_) +
         dense_splits(q, staging_, sm_count_, DenseType::f16);
}

void DeviceZipCache::absorb(const AppendInput& in, const std::vector<std::int64_t>&, cudaStream_t stream) {
  const std::size_t need = static_cast<std::size_t>(staged_) + static_cast<std::size_t>(in.S);
  if (need > window_capacity_) {
    check_not_capturing("a window of " + std::to_string(need) + " rows");
    resize_window(std::max(need, static_cast<std::size_t>(staging_)), stream);
  }
  StagingWindow w;
  w.k_out = win_k_.as<std::uint16_t>();
  w.v_out = win_v_.as<std::uint16_t>();
  w.pos_out = win_pos_.as<std::int64_t>();
  w.capacity = static_cast<long long>(window_capacity_);
  launch_window_append(in, w, staged_, stream);
  staged_ = static_cast<int>(need);
  // Every step launches the block's kernels, switched off unless the window is full.
  flush(staged_ >= staging_ ? staged_ / group_rows_ * group_rows_ : 0, stream);
}

void DeviceZipCache::flush(int m, cudaStream_t stream) {
  const std::size_t BH = batch_ * heads_, D = dim_;
  const int n_hi = static_cast<int>(salient_count(static_cast<std::size_t>(m), hi_fraction_));
  if (m > 0) {
    grow_set(hi_, static_cast<std::size_t>(hi_.units) + units_for(n_hi), stream);
    grow_set(lo_, static_cast<std::size_t>(lo_.units) + units_for(m - n_hi), stream);
    grow_mask(static_cast<std::size_t>(compressed_ + m) / 32, stream);
    const std::size_t scratch = BH * static_cast<std::size_t>(m);
    if (norms_.bytes() < scratch * sizeof(double)) check_not_capturing("the block's scratch for " + std::to_string(m) + " rows");
    norms_.reserve(scratch * sizeof(double));
    salient_.reserve(scratch);
    members_.reserve(scratch * sizeof(int));
  }

  ZipFlush f;
  f.k = win_k_.as<std::uint16_t>();
  f.v = win_v_.as<std::uint16_t>();
  f.pos = win_pos_.as<std::int64_t>();
  f.window_capacity = static_cast<long long>(window_capacity_);
  f.BH = static_cast<int>(BH);
  f.D = static_cast<int>(D);
  f.m = m;
  f.n_hi = n_hi;
  f.group_rows = group_rows_;
  f.norms = norms_.as<double>();
  f.salient = salient_.as<std::uint8_t>();
  f.members = members_.as<int>();
  f.mask = mask_.as<std::uint32_t>();
  f.mask_words = static_cast<long long>(mask_words_);
  f.first_token = compressed_;
  f.hi = zip_set(hi_);
  f.lo = zip_set(lo_);
  launch_zip_flush(f, stream);
  if (m == 0) return;
  blocks_.push_back(Block{compressed_, m, n_hi, hi_.units, lo_.units});
  hi_.units += static_cast<int>(units_for(n_hi));
  lo_.units += static_cast<int>(units_for(m - n_hi));
  compressed_ += m;

  // The rest (< one group, so it does not overlap the rows it moves to) goes to the window's front.
  const int rest = staged_ - m;
  if (rest > 0 && in_graph_step()) {
    // A copy on the stream would run before the graph's kernels that read those rows.
    reject(method(), "a replayed step compresses its whole window (one token a step, zipcache_staging a multiple of "
                     "zipcache_group_size); " + std::to_string(rest) + " rows would stay");
  }
  if (rest > 0) {
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(win_k_.as<std::uint16_t>(), window_capacity_ * D * 2,
                                        win_k_.as<std::uint16_t>() + static_cast<std::size_t>(m) * D, window_capacity_ * D * 2,
                                        static_cast<std::size_t>(rest) * D * 2, BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpy2DAsync(win_v_.as<std::uint16_t>(), window_capacity_ * D * 2,
                                        win_v_.as<std::uint16_t>() + static_cast<std::size_t>(m) * D, window_capacity_ * D * 2,
                                        static_cast<std::size_t>(rest) * D * 2, BH, cudaMemcpyDeviceToDevice, stream));
    KVSLIM_CUDA_CHECK(cudaMemcpyAsync(win_pos_.as<std::int64_t>(), win_pos_.as<std::int64_t>() + m,
                                      static_cast<std::size_t>(rest) * sizeof(std::int64_t), cudaMemcpyDeviceToDevice,
                                      stream));
  }
  staged_ = rest;
  // A long prompt's window and scratch go once it is compressed (as the CPU cache gives back its
  // window's memory): what stays is one window of `staging` rows.
  if (window_capacity_ > 2 * static_cast<std::size_t>(staging_) && !in_graph_step()) {
    resize_window(static_cast<std::size_t>(staging_), stream);  // waits for the flush
    norms_.release();
    salient_.release();
    members_.release();
  }
}

PackedRows DeviceZipCache::packed(const SetStore& s) const {
  PackedRows rows;
  rows.k_codes = s.k_codes.as<std::uint8_t>();
  rows.v_codes = s.v_codes.as<std::uint8_t>();
  rows.k_params = s.k_params.as<std::uint16_t>();
  rows.v_params = s.v_params.as<std::uint16_t>();
  rows.k_codes_stride = static_cast<long long>(s.unit_capacity * 32 * dim_ * static_cast<std::size_t>(s.k_bits) / 8);
  rows.v_codes_stride = static_cast<long long>(s.unit_capacity * 32 * dim_ * static_cast<std::size_t>(s.v_bits) / 8);
  rows.params_stride = static_cast<long long>(s.unit_capacity * 2 * dim_);
  rows.pos = s.pos.as<std::int64_t>();
  rows.pos_head_stride = static_cast<long long>(s.unit_capacity * 32);
  rows.n_units = s.units;
  rows.group_units = 1;  // a parameter set per unit
  // Groups of 2+ units: the decode kernel reads each group's parameters once (attend.h); groups of
  // one unit stay on the int8 kernel, which is faster there.
  if (group_rows_ >= 64) rows.unit_starts = s.unit_starts.as<std::uint8_t>();
  rows.k_bits = s.k_bits;
  rows.v_bits = s.v_bits;
  return rows;
}

int DeviceZipCache::launch_segments(const QueryArgs& q, const Partials& parts, bool count_only, cudaStream_t stream) const {
  // The two sets share one wave of CTAs (their splits in proportion to their units) and run side by
  // side: a set after the other, each a wave, waited twice for a wave's slowest CTA (a captured
  // step's graph serialises its nodes) and, at batch 1, ran chains of 2-3 units a warp. The three
  // segments launch in every step, switched off while empty (a replayed step's graph holds all
  // three: kernel_launch.h). Eager: one after the other, each launched early behind the one before
  // (attend.h); captured: the salient set beside the other set and the window.
  DenseRows window;
  window.k = win_k_.as<std::uint16_t>();
  window.v = win_v_.as<std::uint16_t>();
  window.head_stride = static_cast<long long>(window_capacity_ * dim_);
  window.pos = win_pos_.as<std::int64_t>();
  window.n_rows = staged_;
  window.type = DenseType::f16;
  return launch_sets_and_window(q, packed(hi_), packed(lo_), window, parts, count_only, sm_count_, stream);
}

DeviceZipCache::SetSnapshot DeviceZipCache::set_snapshot(const SetStore& s, std::size_t first, std::size_t count) const {
  SetSnapshot out;
  const std::size_t D = dim_, U = static_cast<std::size_t>(s.units);
  out.units = s.units;
  out.k_row_bytes = static_cast<int>(D) * s.k_bits / 8;
  out.v_row_bytes = static_cast<int>(D) * s.v_bits / 8;
  const std::size_t KRB = static_cast<std::size_t>(out.k_row_bytes), VRB = static_cast<std::size_t>(out.v_row_bytes);
  out.k_codes.resize(count);
  out.v_codes.resize(count);
  out.k_params.resize(count);
  out.v_params.resize(count);
  out.pos.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t bh = first + i;
    out.k_codes[i].resize(U * 32 * KRB);
    out.v_codes[i].resize(U * 32 * VRB);
    out.k_params[i].resize(U * 2 * D);
    out.v_params[i].resize(U * 2 * D);
    out.pos[i].resize(U * 32);
    if (U == 0) continue;
    if (i == 0) {
      out.unit_starts.resize(U);
      KVSLIM_CUDA_CHECK(cudaMemcpy(out.unit_starts.data(), s.unit_starts.get(), U, cudaMemcpyDeviceToHost));
    }
    const std::size_t cap = s.unit_capacity;
    KVSLIM_CUDA_CHECK(cudaMemcpy(out.k_codes[i].data(), s.k_codes.as<std::uint8_t>() + bh * cap * 32 * KRB, U * 32 * KRB,
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(out.v_codes[i].data(), s.v_codes.as<std::uint8_t>() + bh * cap * 32 * VRB, U * 32 * VRB,
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(out.k_params[i].data(), s.k_params.as<std::uint16_t>() + bh * cap * 2 * D, U * 4 * D,
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(out.v_params[i].data(), s.v_params.as<std::uint16_t>() + bh * cap * 2 * D, U * 4 * D,
                                 cudaMemcpyDeviceToHost));
    KVSLIM_CUDA_CHECK(cudaMemcpy(out.pos[i].data(), s.pos.as<std::int64_t>() + bh * cap * 32, U * 32 * 8,
                                 cudaMemcpyDeviceToHost));
  }
  return out;
}

DeviceZipCache::Snapshot DeviceZipCache::snapshot() const {
  synchronize();
  return snapshot_heads(0, batch_ * heads_);
}

DeviceZipCache::Snapshot DeviceZipCache::snapshot_heads(std::size_t first, std::size_t count) const {
  Snapshot s;
  s.hi = set_snapshot(hi_, first, count);
  s.lo = set_snapshot(lo_, first, count);
  s.blocks = blocks_;
  s.staged = staged_;
  const std::size_t D = dim_, words = static_cast<std::size_t>(compressed_) / 32;
  s.mask.resize(count);
  s.stage_k.resize(count);
  s.stage_v.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t bh = first + i;
    s.mask[i].resize(words);
    if (words > 0) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.mask[i].data(), mask_.as<std::uint32_t>() + bh * mask_words_, words * 4,
                                   cudaMemcpyDeviceToHost));
    }
    s.stage_k[i].resize(static_cast<std::size_t>(staged_) * D);
    s.stage_v[i].resize(static_cast<std::size_t>(staged_) * D);
    if (staged_ > 0) {
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.stage_k[i].data(), win_k_.as<std::uint16_t>() + bh * window_capacity_ * D,
                                   s.stage_k[i].size() * 2, cudaMemcpyDeviceToHost));
      KVSLIM_CUDA_CHECK(cudaMemcpy(s.stage_v[i].data(), win_v_.as<std::uint16_t>() + bh * window_capacity_ * D,
                                   s.stage_v[i].size() * 2, cudaMemcpyDeviceToHost));
    }
  }
  return s;
}

void DeviceZipCache::download_rows(std::size_t bh, std::uint16_t* keys, std::uint16_t* values) const {
  // Token order, as the CPU cache's view: each block's rows decoded from their set's units (the
  // saliency bits say which set, in token order), then the window.
  const Snapshot s = snapshot_heads(bh, 1);  // materialize() has synchronized
  const std::size_t D = dim_;
  const auto& k = quant::simd_kernels();
  std::vector<float> scale(D), zero(D);
  for (const Block& b : s.blocks) {
    int next_hi = 0, next_lo = 0;
    for (int t = 0; t < b.tokens; ++t) {
      const long long token = b.first_token + t;
      const bool salient = (s.mask[0][static_cast<std::size_t>(token / 32)] >> (token % 32)) & 1u;
      const SetSnapshot& set = salient ? s.hi : s.lo;
      const int row = (salient ? b.hi_unit0 : b.lo_unit0) * 32 + (salient ? next_hi++ : next_lo++);
      const std::size_t unit = static_cast<std::size_t>(row / 32);
      for (int which = 0; which < 2; ++which) {
        const std::uint16_t* p = (which ? set.v_params : set.k_params)[0].data() + unit * 2 * D;
        k.params_to_f32(p, p + D, D, scale.data(), zero.data());
        const std::size_t RB = static_cast<std::size_t>(which ? set.v_row_bytes : set.k_row_bytes);
        std::uint16_t* out = (which ? values : keys) + static_cast<std::size_t>(token) * D;
        k.decode_rows_f16((which ? set.v_codes : set.k_codes)[0].data() + static_cast<std::size_t>(row) * RB, 1, D,
                          scale.data(), zero.data(), static_cast<int>(RB * 8 / D), &out);
      }
    }
  }
  std::copy(s.stage_k[0].begin(), s.stage_k[0].end(), keys + static_cast<std::size_t>(compressed_) * D);
  std::copy(s.stage_v[0].begin(), s.stage_v[0].end(), values + static_cast<std::size_t>(compressed_) * D);
}

void DeviceZipCache::clear() {
  for (SetStore* s : {&hi_, &lo_}) {
    s->k_codes.release();
    s->v_codes.release();
    s->k_params.release();
    s->v_params.release();
    s->pos.release();
    s->unit_starts.release();
    s->unit_capacity = 0;
    s->units = 0;
  }
  win_k_.release();
  win_v_.release();
  win_pos_.release();
  window_capacity_ = 0;
  staged_ = 0;
  mask_.release();
  mask_words_ = 0;
  norms_.release();
  salient_.release();
  members_.release();
  blocks_.clear();
  compressed_ = 0;
}

void DeviceZipCache::add_figures(CacheStats& st) const {
  long long salient = 0;
  for (const Block& b : blocks_) salient += b.n_hi;
  st.figures.emplace_back("zipcache_hi_bits", hi_.k_bits);
  st.figures.emplace_back("zipcache_lo_bits", lo_.k_bits);
  st.figures.emplace_back("zipcache_value_bits", value_bits_);
  st.figures.emplace_back("zipcache_group_size", group_rows_);
  st.figures.emplace_back("staging_tokens", staged_);
  st.figures.emplace_back("compressed_blocks", static_cast<double>(blocks_.size()));
  st.figures.emplace_back("salient_tokens", static_cast<double>(salient));  // of each head
  // Slots of the sets' part-filled units (held in memory, masked in attention).
  st.figures.emplace_back("empty_slots", static_cast<double>((hi_.units + lo_.units) * 32LL - compressed_));
}

}  // namespace kvslim::cuda
