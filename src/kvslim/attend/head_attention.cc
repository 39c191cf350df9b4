#include "attend/head_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "attend/attend_kernels.h"
#include "kvslim/errors.h"
#include "quant/quant_kernels.h"

namespace kvslim::attend {
namespace {
// fp16 rows per softmax step: the tile's keys and values (64 x 128 x 2 B each) stay in L1/L2
// between the score pass and the value pass.
constexpr std::size_t kTile = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}  // namespace

void HeadAttention::begin(const QueryBlock& queries, std::span<const std::int64_t> query_positions, std::size_t b,
                          std::size_t g, std::size_t group, std::size_t rows_total, bool keep_probs) {
  S_ = queries.tokens;
  H_ = queries.heads;
  D_ = queries.head_dim;
  group_ = group;
  b_ = b;
  g_ = g;
  M_ = S_ * group;
  rows_total_ = rows_total;
  keep_probs_ = keep_probs;
  const float scale = queries.scale != 0.0f ? queries.scale : 1.0f / std::sqrt(static_cast<float>(D_));
  q_.resize(M_ * D_);
  qpos_.resize(M_);
  min_qpos_ = std::numeric_limits<std::int64_t>::max();
  for (std::size_t s = 0; s < S_; ++s) {
    min_qpos_ = std::min(min_qpos_, query_positions[s]);
    for (std::size_t j = 0; j < group; ++j) {
      const std::size_t m = s * group + j;
      const float* src = queries.data + ((b * S_ + s) * H_ + g * group + j) * D_;
      for (std::size_t c = 0; c < D_; ++c) q_[m * D_ + c] = src[c] * scale;
      qpos_[m] = query_positions[s];
    }
  }
  max_.assign(M_, kNegInf);
  sum_.assign(M_, 0.0f);
  acc_.assign(M_ * D_, 0.0f);
  if (keep_probs_) kept_.assign(M_ * rows_total_, kNegInf);
}

void HeadAttention::softmax_step(float* scores, std::size_t ld, const std::int64_t* pos, std::int64_t newest,
                                 std::size_t n, std::size_t first) {
  // Causal mask by true position; skipped when every row precedes every query (decode).
  if (newest > min_qpos_) {
    for (std::size_t m = 0; m < M_; ++m) {
      for (std::size_t r = 0; r < n; ++r) {
        if (pos[r] > qpos_[m]) scores[m * ld + r] = kNegInf;
      }
    }
  }
  for (std::size_t m = 0; m < M_; ++m) {
    float* row = scores + m * ld;
    if (keep_probs_) std::copy_n(row, n, kept_.data() + m * rows_total_ + first);
    const float mx = max_f32(row, n);
    if (mx == kNegInf) {  // every row of the segment is in this query's future
      std::fill_n(row, n, 0.0f);
      continue;
    }
    const float new_max = std::max(max_[m], mx);
    const float corr = max_[m] == kNegInf ? 0.0f : std::exp(max_[m] - new_max);
    const float seg_sum = exp_shift(row, n, new_max);
    if (corr != 1.0f) {
      sum_[m] *= corr;
      float* a = acc_.data() + m * D_;
      for (std::size_t c = 0; c < D_; ++c) a[c] *= corr;
    }
    sum_[m] += seg_sum;
    max_[m] = new_max;
  }
}

namespace {
// Rows [r0, r0 + cnt) of an fp16 row set requested into L2 (a no-op past the end: prefetches never
// fault). In decode the rows come from memory (a step streams the model's weights, which evicts
// the cache's rows), and a tile's keys, then its values, are short bursts that the hardware
// prefetcher does not get ahead of: the next tile is requested while this one is computed.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  // As an asm statement: GCC deletes a loop of __builtin_prefetch alone as side-effect free.
  __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}
void prefetch_rows(const std::uint16_t* rows, std::size_t stride, std::size_t D, std::size_t cnt) {
  const auto* p = reinterpret_cast<const char*>(rows);
  if (stride == D) {
    for (std::size_t o = 0; o < cnt * D * 2; o += 64) prefetch_l2(p + o);
    return;
  }
  for (std::size_t r = 0; r < cnt; ++r) {
    for (std::size_t o = 0; o < D * 2; o += 64) prefetch_l2(p + r * stride * 2 + o);
  }
}
}  // namespace

void HeadAttention::fp16_rows(const std::uint16_t* keys, const std::uint16_t* values, std::size_t stride,
                              const std::int64_t* pos, std::size_t n, std::size_t first) {
  if (scores_.size() < M_ * kTile) scores_.resize(M_ * kTile);
  prefetch_rows(values, stride, D_, std::min(kTile, n));
  for (std::size_t r0 = 0; r0 < n; r0 += kTile) {
    const std::size_t cnt = std::min(kTile, n - r0);
    const std::size_t next = r0 + cnt < n ? std::min(kTile, n - r0 - cnt) : 0;
    prefetch_rows(keys + (r0 + cnt) * stride, stride, D_, next);
    logits_f16(q_.data(), M_, D_, keys + r0 * stride, stride, cnt, scores_.data(), kTile);
    softmax_step(scores_.data(), kTile, pos + r0, max_i64(pos + r0, cnt), cnt, first + r0);
    prefetch_rows(values + (r0 + cnt) * stride, stride, D_, next);
    accumulate_f16(scores_.data(), kTile, M_, values + r0 * stride, stride, cnt, D_, acc_.data());
  }
}

void HeadAttention::packed_block(const ZipCompressed& keys, const GroupQuantized* values,
                                 const std::uint16_t* raw_values, const std::int64_t* pos, std::int64_t newest,
                                 std::size_t n, std::size_t first) {
  if (n == 0) return;
  if (scores_.size() < M_ * n) scores_.resize(M_ * n);
  const bool int8 = (keys.hi.rows == 0 || packed_int8_supported(D_, keys.hi.bits)) &&
                    (keys.lo.rows == 0 || packed_int8_supported(D_, keys.lo.bits));
  if (!int8) {
    packed_logits_fp32(keys, n);
  } else if (keys.mask_bits.empty()) {  // one set holds every token
    const GroupQuantized& set = keys.hi.rows != 0 ? keys.hi : keys.lo;
    logits_packed_int8(q_.data(), set.scale.data(), set.zero.data(), set.group_size, M_, D_, set.codes.data(),
                       set.bits, set.rows, scores_.data(), n);
  } else {
    // Each set scores its own rows, then the two are merged into token order by the mask.
    set_scores_.resize(M_ * n);
    float* hi = set_scores_.data();
    float* lo = hi + M_ * keys.hi.rows;
    for (const auto& [set, dst] : {std::pair{&keys.hi, hi}, std::pair{&keys.lo, lo}}) {
      logits_packed_int8(q_.data(), set->scale.data(), set->zero.data(), set->group_size, M_, D_, set->codes.data(),
                         set->bits, set->rows, dst, set->rows);
    }
    merge_by_mask_int8(hi, keys.hi.rows, lo, keys.lo.rows, keys.mask_bits.data(), M_, n, scores_.data(), n);
  }
  softmax_step(scores_.data(), n, pos, newest, n, first);
  if (values != nullptr) {
    grouped_values(*values, scores_.data(), n);
  } else {
    accumulate_f16(scores_.data(), n, M_, raw_values, D_, n, D_, acc_.data());
  }
}

// The fp32 kernels: per group, q . (code * scale + zero) = (q * scale) . code + q . zero. A mixed
// block scatters each set's scores over the tokens by the token index of every row, hi then lo.
void HeadAttention::packed_logits_fp32(const ZipCompressed& keys, std::size_t n) {
  const auto& k = quant::simd_kernels();
  qs_.resize(M_ * D_);
  bias_.resize(M_);
  scale_.resize(D_);
  zero_.resize(D_);
  const bool mixed = !keys.mask_bits.empty();
  if (mixed) {
    index_.resize(n);
    std::uint32_t* hi_at = index_.data();
    std::uint32_t* lo_at = index_.data() + keys.hi.rows;
    // Branch-free (the mask is random to the predictor): write both, advance the one it names.
    std::size_t nh = 0, nl = 0;
    for (std::size_t s = 0; s < n; ++s) {
      const std::size_t bit = (keys.mask_bits[s / 8] >> (s % 8)) & 1u;
      if (nh < keys.hi.rows) hi_at[nh] = static_cast<std::uint32_t>(s);
      if (nl < keys.lo.rows) lo_at[nl] = static_cast<std::uint32_t>(s);
      nh += bit;
      nl += 1 - bit;
    }
  }
  for (const GroupQuantized* set : {&keys.hi, &keys.lo}) {
    if (set->rows == 0) continue;
    const std::uint32_t* idx = mixed ? index_.data() + (set == &keys.hi ? 0 : keys.hi.rows) : nullptr;
    const std::size_t rb = packed_row_bytes(D_, set->bits);
    const bool direct = packed_direct(D_, set->bits);
    if (!direct) codes_.resize(set->group_size * D_);
    for (std::size_t gi = 0; gi < set->groups(); ++gi) {
      const std::size_t r0 = gi * set->group_size, cnt = std::min(set->group_size, set->rows - r0);
      const std::uint8_t* packed = set->codes.data() + r0 * rb;
      k.params_to_f32(set->scale.data() + gi * D_, set->zero.data() + gi * D_, D_, scale_.data(), zero_.data());
      const std::uint32_t* cols = idx != nullptr ? idx + r0 : nullptr;
      float* dst = idx != nullptr ? scores_.data() : scores_.data() + r0;
      scale_queries(q_.data(), M_, D_, scale_.data(), zero_.data(), qs_.data(), bias_.data());
      if (direct) {
        logits_packed(qs_.data(), M_, D_, packed, set->bits, cnt, bias_.data(), cols, dst, n);
      } else {
        k.unpack_rows(packed, cnt, D_, set->bits, codes_.data());
        logits_codes(qs_.data(), M_, D_, codes_.data(), cnt, bias_.data(), cols, dst, n);
      }
    }
  }
}

// sum_r p[r] (code[r] * scale + zero) = scale * sum_r p[r] code[r] + zero * sum_r p[r], per group.
void HeadAttention::grouped_values(const GroupQuantized& set, const float* p, std::size_t ld) {
  // Integer dot products on the packed bytes, every group in one call; else the fp32 kernels.
  if (accumulate_packed_int8(p, ld, M_, set.codes.data(), set.bits, set.rows, D_, set.group_size, set.scale.data(),
                             set.zero.data(), acc_.data())) {
    return;
  }
  const auto& k = quant::simd_kernels();
  const std::size_t rb = packed_row_bytes(D_, set.bits);
  const bool direct = packed_direct(D_, set.bits);
  if (!direct) codes_.resize(set.group_size * D_);
  scale_.resize(D_);
  zero_.resize(D_);
  gacc_.resize(M_ * D_);
  gsum_.resize(M_);
  for (std::size_t gi = 0; gi < set.groups(); ++gi) {
    const std::size_t r0 = gi * set.group_size, cnt = std::min(set.group_size, set.rows - r0);
    const std::uint8_t* packed = set.codes.data() + r0 * rb;
    k.params_to_f32(set.scale.data() + gi * D_, set.zero.data() + gi * D_, D_, scale_.data(), zero_.data());
    std::fill(gacc_.begin(), gacc_.end(), 0.0f);
    if (direct) {
      accumulate_packed(p + r0, ld, M_, packed, set.bits, cnt, D_, gacc_.data());
    } else {
      k.unpack_rows(packed, cnt, D_, set.bits, codes_.data());
      accumulate_codes(p + r0, ld, M_, codes_.data(), cnt, D_, gacc_.data());
    }
    for (std::size_t m = 0; m < M_; ++m) {
      const float* pm = p + m * ld + r0;
      float ps = 0.0f;
      for (std::size_t r = 0; r < cnt; ++r) ps += pm[r];
      gsum_[m] = ps;
    }
    combine_group(gacc_.data(), gsum_.data(), M_, D_, scale_.data(), zero_.data(), acc_.data());
  }
}

void HeadAttention::finish(float* out, float* probs) {
  for (std::size_t m = 0; m < M_; ++m) {
    const std::size_t s = m / group_, j = m % group_;
    float* o = out + ((b_ * S_ + s) * H_ + g_ * group_ + j) * D_;
    const float inv = sum_[m] > 0.0f ? 1.0f / sum_[m] : 0.0f;
    const float* a = acc_.data() + m * D_;
    for (std::size_t c = 0; c < D_; ++c) o[c] = a[c] * inv;
  }
  if (probs == nullptr || !keep_probs_) return;
  const std::size_t kv_heads = H_ / group_;
  for (std::size_t s = 0; s < S_; ++s) {
    float* dst = probs + ((b_ * kv_heads + g_) * S_ + s) * rows_total_;
    std::fill_n(dst, rows_total_, 0.0f);
    for (std::size_t j = 0; j < group_; ++j) {
      const std::size_t m = s * group_ + j;
      if (sum_[m] <= 0.0f) continue;
      const float* kept = kept_.data() + m * rows_total_;
      const float inv = 1.0f / sum_[m], mx = max_[m];
      for (std::size_t i = 0; i < rows_total_; ++i) {
        if (kept[i] != kNegInf) dst[i] += std::exp(kept[i] - mx) * inv;
      }
    }
  }
}

void run(std::string_view method, std::size_t batch, std::size_t kv_heads, std::size_t head_dim, std::size_t rows,
         const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out, float* probs,
         const ParallelFor* parallel,
         const std::function<void(HeadAttention&, std::size_t b, std::size_t g)>& task) {
  const std::string m(method);
  const auto fail = [&](const std::string& what) { throw InputError(m + " cache: attend: " + what); };
  if (queries.space != MemorySpace::host) {
    fail("queries are in " + std::string(memory_space_name(queries.space)) +
         " memory; this cache is on the CPU (build it with KVCacheConfig.device = \"cuda\" for device queries)");
  }
  if (queries.tokens == 0) return;
  if (queries.data == nullptr || out == nullptr) fail("queries and out must not be null");
  if (query_positions.size() != queries.tokens) {
    fail(std::to_string(query_positions.size()) + " query positions for " + std::to_string(queries.tokens) +
         " query tokens");
  }
  if (!(std::isfinite(queries.scale))) fail("scale must be finite");
  if (batch == 0) {  // nothing appended: every query sees no row
    if (queries.heads == 0 || queries.head_dim == 0) fail("queries need heads >= 1 and head_dim >= 1");
    std::fill_n(out, queries.batch * queries.tokens * queries.heads * queries.head_dim, 0.0f);
    return;
  }
  if (queries.batch != batch || queries.head_dim != head_dim || queries.heads == 0 || queries.heads % kv_heads != 0) {
    fail("queries [batch=" + std::to_string(queries.batch) + ", tokens=" + std::to_string(queries.tokens) +
         ", heads=" + std::to_string(queries.heads) + ", head_dim=" + std::to_string(queries.head_dim) +
         "] do not match the cache [batch=" + std::to_string(batch) + ", kv_heads=" + std::to_string(kv_heads) +
         ", head_dim=" + std::to_string(head_dim) + "] (heads must be a multiple of kv_heads)");
  }
  const std::size_t group = queries.heads / kv_heads;
  const bool keep_probs = probs != nullptr;
  auto one = [&](std::size_t t) {
    thread_local HeadAttention head;  // scratch reused across calls on this thread
    const std::size_t b = t / kv_heads, g = t % kv_heads;
    head.begin(queries, query_positions, b, g, group, rows, keep_probs);
    task(head, b, g);
    head.finish(out, probs);
  };
  const std::size_t n = batch * kv_heads;
  if (parallel != nullptr && *parallel && n > 1) {
    (*parallel)(n, one);
  } else {
    for (std::size_t t = 0; t < n; ++t) one(t);
  }
}

}  // namespace kvslim::attend
