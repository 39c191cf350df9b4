// The §4.2 group quantizer with fp16 parameters and bit-packed codes, and the mixed-precision
// ZipCache block built from two such sets.
#include "quant/group_quant.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvslim/dtype.h"
#include "kvslim/errors.h"

namespace kvslim {
namespace quant {
namespace {

void check_bits(int bits, const char* what) {
  if (bits < 1 || bits > 8) {
    throw std::invalid_argument(std::string(what) + ": bits must be in 1..8, got " + std::to_string(bits));
  }
}

void check_rows(std::span<const float> rows, std::size_t n, std::size_t dim, const char* what) {
  if (dim == 0) throw std::invalid_argument(std::string(what) + ": head dimension D must be >= 1");
  if (rows.size() != n * dim) {
    throw std::invalid_argument(std::string(what) + ": rows holds " + std::to_string(rows.size()) +
                                " values, expected " + std::to_string(n) + " x " + std::to_string(dim));
  }
  const std::size_t bad = simd_kernels().first_unrepresentable(rows.data(), rows.size());
  if (bad != rows.size()) {
    throw InputError(std::string(what) + ": rows[" + std::to_string(bad / dim) + ", " + std::to_string(bad % dim) +
                     "] = " + std::to_string(rows[bad]) + " is not finite or exceeds the fp16 range (|x| <= 65504)");
  }
}

std::vector<const float*> row_pointers(std::span<const float> rows, std::size_t n, std::size_t dim) {
  std::vector<const float*> ptrs(n);
  for (std::size_t r = 0; r < n; ++r) ptrs[r] = rows.data() + r * dim;
  return ptrs;
}

}  // namespace

namespace {

// Rows of one group as fp32 pointers: fp32 rows as they are; fp16 rows converted into `buffer`
// ([group_size, dim], small enough to stay in L1/L2: the data is read from memory once).
const float* const* group_rows(const float* const* rows, std::size_t count, std::size_t, const Kernels&,
                               std::vector<float>&, std::vector<const float*>&) {
  (void)count;
  return rows;
}
const float* const* group_rows(const std::uint16_t* const* rows, std::size_t count, std::size_t dim, const Kernels& k,
                               std::vector<float>& buffer, std::vector<const float*>& ptrs) {
  buffer.resize(count * dim);
  ptrs.resize(count);
  k.rows_f16_to_f32(rows, count, dim, buffer.data());
  for (std::size_t r = 0; r < count; ++r) ptrs[r] = buffer.data() + r * dim;
  return ptrs.data();
}

template <typename T>
GroupQuantized quantize_set(const T* const* rows, std::size_t n, std::size_t dim, int bits, std::size_t group_size,
                            const Kernels& k) {
  GroupQuantized q;
  q.rows = n;
  q.dim = dim;
  q.bits = bits;
  q.group_size = group_size;
  const std::size_t rb = packed_row_bytes(dim, bits), groups = q.groups();
  q.codes = std::vector<std::uint8_t>(n * rb);
  q.scale = std::vector<std::uint16_t>(groups * dim);
  q.zero = std::vector<std::uint16_t>(groups * dim);
  std::vector<float> mn(dim), mx(dim), scale_f(dim), zero_f(dim), buffer;
  std::vector<const float*> ptrs;
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t r0 = g * group_size, count = std::min(group_size, n - r0);
    const float* const* grows = group_rows(rows + r0, count, dim, k, buffer, ptrs);
    // The last group is padded by repeating its last row in the original: min/max are unchanged,
    // so the padding is never materialised.
    k.group_minmax(grows, count, dim, mn.data(), mx.data());
    k.make_params(mn.data(), mx.data(), dim, bits, q.scale.data() + g * dim, q.zero.data() + g * dim, scale_f.data(),
                  zero_f.data());
    k.encode_pack_rows(grows, count, dim, scale_f.data(), zero_f.data(), bits, q.codes.data() + r0 * rb);
  }
  return q;
}

template <typename T>
ZipCompressed zip_compress_set(const T* const* rows, std::size_t S, std::size_t dim, const std::uint8_t* mask,
                               int hi_bits, int lo_bits, std::size_t group_size, const Kernels& k) {
  ZipCompressed z;
  z.seq_len = S;
  z.head_dim = dim;
  z.group_size = group_size;
  // Stable partition: each set keeps the tokens' relative order.
  std::vector<const T*> hi_rows, lo_rows;
  hi_rows.reserve(S);
  lo_rows.reserve(S);
  for (std::size_t s = 0; s < S; ++s) (mask[s] ? hi_rows : lo_rows).push_back(rows[s]);
  z.n_hi = hi_rows.size();
  if (z.n_hi != 0 && z.n_hi != S) {
    z.mask_bits = std::vector<std::uint8_t>((S + 7) / 8);
    for (std::size_t s = 0; s < S; ++s) {
      if (mask[s]) z.mask_bits[s / 8] |= static_cast<std::uint8_t>(1u << (s % 8));
    }
  }
  z.hi = quantize_set(hi_rows.data(), hi_rows.size(), dim, hi_bits, group_size, k);
  z.lo = quantize_set(lo_rows.data(), lo_rows.size(), dim, lo_bits, group_size, k);
  return z;
}

}  // namespace

GroupQuantized quantize_row_set(const float* const* rows, std::size_t n, std::size_t dim, int bits,
                                std::size_t group_size, const Kernels& k) {
  return quantize_set(rows, n, dim, bits, group_size, k);
}
GroupQuantized quantize_row_set(const std::uint16_t* const* rows, std::size_t n, std::size_t dim, int bits,
                                std::size_t group_size, const Kernels& k) {
  return quantize_set(rows, n, dim, bits, group_size, k);
}

void decode_set_f16(const GroupQuantized& q, std::uint16_t* const* out_rows, const Kernels& k) {
  const std::size_t rb = packed_row_bytes(q.dim, q.bits);
  thread_local std::vector<float> scale_f, zero_f;  // [dim]: decoding runs every update, allocate once
  scale_f.resize(q.dim);
  zero_f.resize(q.dim);
  for (std::size_t g = 0; g < q.groups(); ++g) {
    const std::size_t r0 = g * q.group_size, count = std::min(q.group_size, q.rows - r0);
    k.params_to_f32(q.scale.data() + g * q.dim, q.zero.data() + g * q.dim, q.dim, scale_f.data(), zero_f.data());
    k.decode_rows_f16(q.codes.data() + r0 * rb, count, q.dim, scale_f.data(), zero_f.data(), q.bits, out_rows + r0);
  }
}

void decode_set_f32(const GroupQuantized& q, float* const* out_rows, const Kernels& k) {
  const std::size_t rb = packed_row_bytes(q.dim, q.bits);
  std::vector<float> scale_f(q.dim), zero_f(q.dim);
  for (std::size_t g = 0; g < q.groups(); ++g) {
    const std::size_t r0 = g * q.group_size, count = std::min(q.group_size, q.rows - r0);
    k.params_to_f32(q.scale.data() + g * q.dim, q.zero.data() + g * q.dim, q.dim, scale_f.data(), zero_f.data());
    k.decode_rows_f32(q.codes.data() + r0 * rb, count, q.dim, scale_f.data(), zero_f.data(), q.bits, out_rows + r0);
  }
}

ZipCompressed zip_compress_rows(const float* const* rows, std::size_t S, std::size_t dim, const std::uint8_t* mask,
                                int hi_bits, int lo_bits, std::size_t group_size, const Kernels& k) {
  return zip_compress_set(rows, S, dim, mask, hi_bits, lo_bits, group_size, k);
}
ZipCompressed zip_compress_rows(const std::uint16_t* const* rows, std::size_t S, std::size_t dim,
                                const std::uint8_t* mask, int hi_bits, int lo_bits, std::size_t group_size,
                                const Kernels& k) {
  return zip_compress_set(rows, S, dim, mask, hi_bits, lo_bits, group_size, k);
}

std::vector<double> row_norms_f16(const std::uint16_t* const* rows, std::size_t S, std::size_t dim, const Kernels& k) {
  std::vector<double> norms(S);
  k.row_norms_f16(rows, S, dim, norms.data());
  return norms;
}

void zip_decode_f16(const ZipCompressed& z, std::uint16_t* out, std::size_t out_stride, const Kernels& k) {
  thread_local std::vector<std::uint16_t*> hi_rows, lo_rows;  // destination of each set's rows
  hi_rows.clear();
  lo_rows.clear();
  for (std::size_t s = 0; s < z.seq_len; ++s) (z.salient(s) ? hi_rows : lo_rows).push_back(out + s * out_stride);
  decode_set_f16(z.hi, hi_rows.data(), k);
  decode_set_f16(z.lo, lo_rows.data(), k);
}

}  // namespace quant

// ---- public API (kvslim/zipcache.h) ----

std::size_t packed_row_bytes(std::size_t D, int bits) {
  quant::Plane planes[4];
  const int n = quant::code_planes(bits, planes);
  std::size_t total = 0;
  for (int i = 0; i < n; ++i) total += quant::plane_bytes(D, planes[i].width);
  return total;
}

std::size_t GroupQuantized::resident_bytes() const {
  return codes.capacity() + (scale.capacity() + zero.capacity()) * sizeof(std::uint16_t);
}

GroupQuantized quantize_groups(std::span<const float> rows, std::size_t n, std::size_t D, int bits,
                               std::size_t group_size) {
  quant::check_bits(bits, "quantize_groups");
  if (group_size == 0) throw std::invalid_argument("quantize_groups: group_size must be >= 1");
  quant::check_rows(rows, n, D, "quantize_groups");
  const auto ptrs = quant::row_pointers(rows, n, D);
  return quant::quantize_row_set(ptrs.data(), n, D, bits, group_size);
}

std::vector<float> dequantize_groups(const GroupQuantized& q) {
  std::vector<float> out(q.rows * q.dim);
  std::vector<float*> ptrs(q.rows);
  for (std::size_t r = 0; r < q.rows; ++r) ptrs[r] = out.data() + r * q.dim;
  quant::decode_set_f32(q, ptrs.data());
  return out;
}

std::vector<double> token_key_norms(std::span<const float> rows, std::size_t S, std::size_t D) {
  quant::check_rows(rows, S, D, "token_key_norms");
  std::vector<double> norms(S);
  const auto& k = quant::simd_kernels();
  for (std::size_t s = 0; s < S; ++s) norms[s] = std::sqrt(k.sum_squares(rows.data() + s * D, D));
  return norms;
}

std::size_t salient_count(std::size_t S, double hi_fraction) {
  if (!(hi_fraction >= 0.0 && hi_fraction <= 1.0)) {
    throw std::invalid_argument("saliency_mask: hi_fraction must be in [0, 1], got " + std::to_string(hi_fraction));
  }
  const double n = std::ceil(static_cast<double>(S) * hi_fraction);  // double: 0.3 * 100 = 30, not 31
  return std::min(S, static_cast<std::size_t>(std::max(n, 0.0)));
}

std::vector<std::uint8_t> saliency_mask(std::span<const double> norms, double hi_fraction) {
  const std::size_t S = norms.size(), n_hi = salient_count(S, hi_fraction);
  std::vector<std::uint8_t> mask(S, 0);
  if (n_hi == 0) return mask;
  if (n_hi >= S) {
    std::fill(mask.begin(), mask.end(), std::uint8_t{1});
    return mask;
  }
  for (std::size_t s = 0; s < S; ++s) {
    if (std::isnan(norms[s])) throw std::invalid_argument("saliency_mask: norms[" + std::to_string(s) + "] is NaN");
  }
  // The tail of a stable ascending sort (ties: the later index ranks higher) is the top n_hi under
  // the total order (norm, index): a selection, O(S), finds the same set.
  std::vector<std::size_t> order(S);
  std::iota(order.begin(), order.end(), std::size_t{0});
  const auto before = [&](std::size_t a, std::size_t b) { return norms[a] < norms[b] || (norms[a] == norms[b] && a < b); };
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(S - n_hi), order.end(), before);
  for (std::size_t r = S - n_hi; r < S; ++r) mask[order[r]] = 1;
  return mask;
}

bool ZipCompressed::salient(std::size_t s) const {
  if (mask_bits.empty()) return n_hi == seq_len && seq_len != 0;
  return (mask_bits[s / 8] >> (s % 8)) & 1u;
}

std::vector<std::uint8_t> ZipCompressed::mask() const {
  std::vector<std::uint8_t> m(seq_len);
  for (std::size_t s = 0; s < seq_len; ++s) m[s] = salient(s) ? 1 : 0;
  return m;
}

std::size_t ZipCompressed::resident_bytes() const {
  return mask_bits.capacity() + hi.resident_bytes() + lo.resident_bytes();
}

ZipCompressed zip_compress_masked(std::span<const float> rows, std::size_t S, std::size_t D,
                                  std::span<const std::uint8_t> mask, int hi_bits, int lo_bits,
                                  std::size_t group_size) {
  quant::check_bits(hi_bits, "zip_compress: hi_bits");
  quant::check_bits(lo_bits, "zip_compress: lo_bits");
  if (group_size == 0) throw std::invalid_argument("zip_compress: group_size must be >= 1");
  if (mask.size() != S) {
    throw std::invalid_argument("zip_compress: mask has " + std::to_string(mask.size()) + " entries, expected " +
                                std::to_string(S));
  }
  quant::check_rows(rows, S, D, "zip_compress");
  const auto ptrs = quant::row_pointers(rows, S, D);
  return quant::zip_compress_rows(ptrs.data(), S, D, mask.data(), hi_bits, lo_bits, group_size);
}

ZipCompressed zip_compress(std::span<const float> rows, std::size_t S, std::size_t D, int hi_bits, int lo_bits,
                           double hi_fraction, std::size_t group_size) {
  const auto norms = token_key_norms(rows, S, D);
  const auto mask = saliency_mask(norms, hi_fraction);
  return zip_compress_masked(rows, S, D, mask, hi_bits, lo_bits, group_size);
}

void zip_reconstruct_into(const ZipCompressed& z, std::uint16_t* out, std::size_t out_stride) {
  quant::zip_decode_f16(z, out, out_stride);
}

std::vector<std::uint16_t> zip_reconstruct(const ZipCompressed& z) {
  std::vector<std::uint16_t> out(z.seq_len * z.head_dim);
  quant::zip_decode_f16(z, out.data(), z.head_dim);
  return out;
}

std::size_t zipcache_accounted_bytes(std::size_t n_hi, std::size_t n_lo, std::size_t S, std::size_t D, int hi_bits,
                                     int lo_bits, std::size_t group_size) {
  const auto ceil_div = [](std::size_t a, std::size_t b) { return (a + b - 1) / b; };
  const std::size_t hi_code = ceil_div(n_hi * D * static_cast<std::size_t>(hi_bits), 8);
  const std::size_t lo_code = ceil_div(n_lo * D * static_cast<std::size_t>(lo_bits), 8);
  const std::size_t hi_params = ceil_div(n_hi, group_size) * D * 2 * 2;  // 0 when n_hi == 0
  const std::size_t lo_params = ceil_div(n_lo, group_size) * D * 2 * 2;
  return hi_code + lo_code + hi_params + lo_params + S;
}

std::size_t base_only_bytes(std::size_t S, std::size_t D, int bits, std::size_t group_size) {
  return (S * D * static_cast<std::size_t>(bits) + 7) / 8 + (S + group_size - 1) / group_size * D * 4;
}

}  // namespace kvslim
