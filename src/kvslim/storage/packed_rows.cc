#include "storage/packed_rows.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "attend/head_attention.h"
#include "kvslim/convert.h"
#include "kvslim/errors.h"
#include "quant/group_quant.h"
#include "quant/quant_kernels.h"

namespace kvslim {

void erase_group_row(GroupQuantized& set, std::size_t r) {
  if (r >= set.rows) throw std::logic_error("erase_group_row: row " + std::to_string(r) + " of " + std::to_string(set.rows));
  if (set.group_size < set.rows) throw std::logic_error("erase_group_row: the set holds more than one group");
  if (set.rows == 1) {  // the group is gone: its parameters too
    set = GroupQuantized{0, set.dim, set.group_size, set.bits, {}, {}, {}};
    return;
  }
  const std::size_t row_bytes = set.codes.size() / set.rows;
  set.codes.erase(set.codes.begin() + static_cast<std::ptrdiff_t>(r * row_bytes),
                  set.codes.begin() + static_cast<std::ptrdiff_t>((r + 1) * row_bytes));
  set.codes.shrink_to_fit();  // resident bytes are what is allocated: give the row back
  --set.rows;
}

void erase_block_row(ZipCompressed& keys, std::size_t r) {
  if (r >= keys.seq_len) throw std::logic_error("erase_block_row: row " + std::to_string(r) + " of " + std::to_string(keys.seq_len));
  std::vector<std::uint8_t> mask = keys.mask();  // [S] 0/1
  const bool salient = mask[r] != 0;
  const std::size_t in_set = static_cast<std::size_t>(std::count(mask.begin(), mask.begin() + static_cast<std::ptrdiff_t>(r), mask[r]));
  erase_group_row(salient ? keys.hi : keys.lo, in_set);
  mask.erase(mask.begin() + static_cast<std::ptrdiff_t>(r));
  --keys.seq_len;
  if (salient) --keys.n_hi;
  // The mask is absent when one set holds every row (ZipCompressed's rule).
  keys.mask_bits.clear();
  if (keys.n_hi != 0 && keys.n_hi != keys.seq_len) {
    keys.mask_bits.assign((keys.seq_len + 7) / 8, 0);
    for (std::size_t s = 0; s < keys.seq_len; ++s) {
      if (mask[s]) keys.mask_bits[s / 8] |= static_cast<std::uint8_t>(1u << (s % 8));
    }
  }
  keys.mask_bits.shrink_to_fit();
}

PackedRows::PackedRows(PackedRowsOptions options) : options_(std::move(options)) {
  const std::string& k = options_.kind;
  if (options_.hi_bits < 1 || options_.hi_bits > 8 || options_.lo_bits < 1 || options_.lo_bits > options_.hi_bits) {
    throw ConfigError(k + " storage: bits must satisfy 1 <= lo_bits <= hi_bits <= 8 (got lo " + std::to_string(options_.lo_bits) +
                      ", hi " + std::to_string(options_.hi_bits) + ")");
  }
  if (options_.value_bits != 0 && (options_.value_bits < 1 || options_.value_bits > 8)) {
    throw ConfigError(k + " storage: value_bits must be 0 (hi_bits) or in [1, 8] (got " + std::to_string(options_.value_bits) + ")");
  }
  if (!(options_.hi_fraction >= 0.0 && options_.hi_fraction <= 1.0)) {
    throw ConfigError(k + " storage: hi_fraction must be in [0, 1], got " + std::to_string(options_.hi_fraction));
  }
  if (options_.group_size == 0) throw ConfigError(k + " storage: group_size must be >= 1");
  options_.staging = std::max<std::size_t>(options_.staging, 1);
}

void PackedRows::begin(std::size_t heads_total, std::size_t dim) {
  dim_ = dim;
  heads_.assign(heads_total, Head{});
}

void PackedRows::relayout(std::size_t, std::size_t keep) {
  // Rows are not slots here: nothing to move. A shrink (the core gives back a prompt's room)
  // gives back the window's spare room too.
  for (Head& h : heads_) {
    if (h.packed + staged(h) > keep) throw std::logic_error(options_.kind + " storage: relayout below the rows held");
    h.stage_keys.shrink_to_fit();
    h.stage_values.shrink_to_fit();
  }
}

void PackedRows::prepare(std::size_t incoming) {
  if (incoming > 1) flush_ = true;
  // Exactly the rows that will wait (the window is resident memory: no geometric spare room).
  for (Head& h : heads_) {
    h.stage_keys.reserve(h.stage_keys.size() + incoming * dim_);
    h.stage_values.reserve(h.stage_values.size() + incoming * dim_);
  }
}

void PackedRows::write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) {
  Head& h = heads_[head];
  if (slot != h.packed + staged(h)) {
    throw std::logic_error(options_.kind + " storage: rows arrive at the end only (slot " + std::to_string(slot) + " of " +
                           std::to_string(h.packed + staged(h)) + ")");
  }
  h.stage_keys.insert(h.stage_keys.end(), key, key + dim_);
  h.stage_values.insert(h.stage_values.end(), value, value + dim_);
}

void PackedRows::move(std::size_t, std::size_t, std::size_t) {
  throw std::logic_error(options_.kind + " storage: rows cannot move between slots (the core erases instead)");
}

void PackedRows::erase(std::size_t head, std::span<const std::size_t> slots) {
  Head& h = heads_[head];
  const std::size_t D = dim_;
  // Last first, so that the earlier slots keep their index.
  std::size_t block = h.blocks.size(), block_first = h.packed;  // block index, its first row
  bool dropped_block = false;
  for (std::size_t i = slots.size(); i-- > 0;) {
    const std::size_t slot = slots[i];
    if (slot >= h.packed) {
      const std::size_t s = slot - h.packed;
      if (s >= staged(h)) throw std::logic_error(options_.kind + " storage: erase of slot " + std::to_string(slot) + " past the rows held");
      h.stage_keys.erase(h.stage_keys.begin() + static_cast<std::ptrdiff_t>(s * D),
                         h.stage_keys.begin() + static_cast<std::ptrdiff_t>((s + 1) * D));
      h.stage_values.erase(h.stage_values.begin() + static_cast<std::ptrdiff_t>(s * D),
                           h.stage_values.begin() + static_cast<std::ptrdiff_t>((s + 1) * D));
      continue;
    }
    while (slot < block_first) block_first -= h.blocks[--block].tokens;
    Block& b = h.blocks[block];
    const std::size_t r = slot - block_first;
    erase_block_row(b.keys, r);
    if (options_.quantize_values) {
      erase_group_row(b.values, r);
    } else {
      b.raw_values.erase(b.raw_values.begin() + static_cast<std::ptrdiff_t>(r * D),
                         b.raw_values.begin() + static_cast<std::ptrdiff_t>((r + 1) * D));
      b.raw_values.shrink_to_fit();
    }
    --b.tokens;
    --h.packed;
    dropped_block = dropped_block || b.tokens == 0;
  }
  if (dropped_block) {
    for (const Block& b : h.blocks) h.made -= b.tokens == 0 ? b.made : 0;
    std::erase_if(h.blocks, [](const Block& b) { return b.tokens == 0; });
  }
}

void PackedRows::settle(std::size_t rows, const Saliency& saliency) {
  const std::size_t G = options_.group_size;
  for (std::size_t head = 0; head < heads_.size(); ++head) {
    Head& h = heads_[head];
    if (h.packed + staged(h) != rows) throw std::logic_error(options_.kind + " storage: the policy and the storage disagree on the rows held");
    // Evictions thinned the groups to under a quarter of the rows they were made with: re-pack
    // them (see repack).
    if (h.blocks.size() >= 4 && 4 * h.packed < h.made) repack(head);
    const std::size_t waiting = staged(h);
    if (flush_ && waiting > 0) {
      compress(head, waiting, saliency);  // a prompt's survivors: whole groups and one short group
    } else if (waiting >= options_.staging) {
      // staging >= group size: the complete groups; below it: every waiting row, as one short
      // group (decode rows leave fp16 `staging` at a time).
      compress(head, options_.staging >= G ? waiting / G * G : waiting, saliency);
    } else if (h.stage_keys.capacity() != h.stage_keys.size()) {  // rows the eviction took from the window
      h.stage_keys.shrink_to_fit();
      h.stage_values.shrink_to_fit();
    }
  }
  flush_ = false;
}

void PackedRows::compress(std::size_t head, std::size_t count, const Saliency& saliency) {
  Head& h = heads_[head];
  const std::size_t D = dim_, G = options_.group_size;
  const auto& k = quant::simd_kernels();
  // One group's rows (sized by the rows at hand: a group size may exceed any context).
  const std::size_t widest = std::min(G, count);
  std::vector<const std::uint16_t*> key_rows(widest), value_rows(widest);
  std::vector<double> score(widest);
  h.blocks.reserve(h.blocks.size() + (count + G - 1) / G);  // exactly: the block list is resident memory too
  for (std::size_t first = 0; first < count; first += G) {
    const std::size_t m = std::min(G, count - first);  // rows of this group (the last may be short)
    key_rows.resize(m);
    value_rows.resize(m);
    score.resize(m);
    for (std::size_t s = 0; s < m; ++s) {
      key_rows[s] = h.stage_keys.data() + (first + s) * D;
      value_rows[s] = h.stage_values.data() + (first + s) * D;
    }
    if (options_.hi_fraction > 0.0) {
      if (options_.attention_saliency) {
        for (std::size_t s = 0; s < m; ++s) score[s] = saliency(head, h.packed + first + s);
      } else {
        score = quant::row_norms_f16(key_rows.data(), m, D, k);
      }
    } else {
      std::fill(score.begin(), score.end(), 0.0);
    }
    const std::vector<std::uint8_t> mask = saliency_mask(score, options_.hi_fraction);
    Block b;
    b.tokens = b.made = m;
    h.made += m;
    b.keys = quant::zip_compress_rows(key_rows.data(), m, D, mask.data(), options_.hi_bits, options_.lo_bits, G, k);
    if (options_.quantize_values) {
      b.values = quant::quantize_row_set(value_rows.data(), m, D, options_.values_at(), G, k);
    } else {
      b.raw_values.assign(h.stage_values.begin() + static_cast<std::ptrdiff_t>(first * D),
                          h.stage_values.begin() + static_cast<std::ptrdiff_t>((first + m) * D));
    }
    h.blocks.push_back(std::move(b));
  }
  h.packed += count;
  const auto drop = static_cast<std::ptrdiff_t>(count * D);
  h.stage_keys.erase(h.stage_keys.begin(), h.stage_keys.begin() + drop);
  h.stage_values.erase(h.stage_values.begin(), h.stage_values.begin() + drop);
  // The window counts as resident: keep only what still waits (it regrows as rows arrive).
  h.stage_keys.shrink_to_fit();
  h.stage_values.shrink_to_fit();
}

void PackedRows::repack(std::size_t head) {
  Head& h = heads_[head];
  const std::size_t D = dim_, G = options_.group_size, n = h.packed;
  // The rows as their codes decode (fp16 [n, D]) and each row's precision, in order.
  std::vector<std::uint16_t> keys(n * D), values(n * D);
  std::vector<std::uint8_t> salient;
  salient.reserve(n);
  decode_head(head, n, keys.data(), values.data());
  for (const Block& b : h.blocks) {
    for (std::size_t s = 0; s < b.tokens; ++s) salient.push_back(b.keys.salient(s) ? 1 : 0);
  }
  const auto& k = quant::simd_kernels();
  std::vector<Block> blocks;
  blocks.reserve((n + G - 1) / G);
  std::vector<const std::uint16_t*> key_rows(std::min(G, n)), value_rows(std::min(G, n));
  for (std::size_t first = 0; first < n; first += G) {
    const std::size_t m = std::min(G, n - first);
    for (std::size_t s = 0; s < m; ++s) {
      key_rows[s] = keys.data() + (first + s) * D;
      value_rows[s] = values.data() + (first + s) * D;
    }
    Block b;
    b.tokens = b.made = m;
    // Each row keeps its precision; the values it decoded to are quantized again on the new
    // group's grid: the only place a row is rounded again, once per re-pack it survives (a
    // re-pack needs the head's groups to fall to a quarter full first).
    b.keys = quant::zip_compress_rows(key_rows.data(), m, D, salient.data() + first, options_.hi_bits, options_.lo_bits, G, k);
    if (options_.quantize_values) {
      b.values = quant::quantize_row_set(value_rows.data(), m, D, options_.values_at(), G, k);
    } else {
      b.raw_values.assign(values.begin() + static_cast<std::ptrdiff_t>(first * D),
                          values.begin() + static_cast<std::ptrdiff_t>((first + m) * D));
    }
    blocks.push_back(std::move(b));
  }
  h.blocks = std::move(blocks);
  h.made = n;
  ++h.repacks;
}

void PackedRows::decode_head(std::size_t head, std::size_t n, std::uint16_t* keys, std::uint16_t* values) const {
  const Head& h = heads_[head];
  const std::size_t D = dim_;
  const auto& k = quant::simd_kernels();
  std::vector<std::uint16_t*> rows;
  std::size_t row = 0;
  for (const Block& b : h.blocks) {
    quant::zip_decode_f16(b.keys, keys + row * D, D, k);
    if (values != nullptr) {
      if (options_.quantize_values) {
        rows.resize(b.tokens);
        for (std::size_t s = 0; s < b.tokens; ++s) rows[s] = values + (row + s) * D;
        quant::decode_set_f16(b.values, rows.data(), k);
      } else {
        std::memcpy(values + row * D, b.raw_values.data(), b.tokens * D * sizeof(std::uint16_t));
      }
    }
    row += b.tokens;
  }
  const std::size_t waiting = n - row;
  if (waiting != 0) {
    std::memcpy(keys + row * D, h.stage_keys.data(), waiting * D * sizeof(std::uint16_t));
    if (values != nullptr) std::memcpy(values + row * D, h.stage_values.data(), waiting * D * sizeof(std::uint16_t));
  }
}

void PackedRows::key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const {
  std::vector<std::uint16_t> keys(n * dim_);  // fp16 [n, D] decoded (the key proxy's slow path)
  decode_head(head, n, keys.data(), nullptr);
  dot_fp16_rows(keys.data(), n, dim_, dim_, query, logits);
}

void PackedRows::feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const {
  const Head& h = heads_[head];
  std::size_t row = 0;
  for (const Block& b : h.blocks) {
    const std::int64_t newest = *std::max_element(pos + row, pos + row + b.tokens);
    ha.packed_block(b.keys, options_.quantize_values ? &b.values : nullptr, b.raw_values.data(), pos + row, newest,
                    b.tokens, row);
    row += b.tokens;
  }
  if (n > row) ha.fp16_rows(h.stage_keys.data(), h.stage_values.data(), dim_, pos + row, n - row, row);
}

CacheView PackedRows::view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                           std::size_t pos_stride) const {
  if (rows == 0 || heads_.empty()) return CacheView{batch, heads, 0, dim_, 0, nullptr, nullptr, nullptr};
  const std::size_t D = dim_, n_heads = heads_.size();
  ViewScratch& sc = scratch_;
  sc.keys.resize(n_heads * rows * D);
  sc.values.resize(n_heads * rows * D);
  sc.positions.resize(n_heads * rows);
  for (std::size_t head = 0; head < n_heads; ++head) {
    decode_head(head, rows, sc.keys.data() + head * rows * D, sc.values.data() + head * rows * D);
    std::copy_n(positions + head * pos_stride, rows, sc.positions.begin() + static_cast<std::ptrdiff_t>(head * rows));
  }
  CacheView v;
  v.batch = batch;
  v.heads = heads;
  v.tokens = rows;
  v.head_dim = D;
  v.head_stride = rows;
  v.keys = sc.keys.data();
  v.values = sc.values.data();
  v.positions = sc.positions.data();
  return v;
}

std::size_t PackedRows::resident_bytes() const {
  std::size_t bytes = heads_.capacity() * sizeof(Head);
  for (const Head& h : heads_) {
    bytes += h.blocks.capacity() * sizeof(Block);
    bytes += (h.stage_keys.capacity() + h.stage_values.capacity()) * sizeof(std::uint16_t);
    for (const Block& b : h.blocks) {
      bytes += b.keys.resident_bytes() + b.values.resident_bytes() + b.raw_values.capacity() * sizeof(std::uint16_t);
    }
  }
  return bytes;
}

void PackedRows::reset() {
  dim_ = 0;
  heads_.clear();
  heads_.shrink_to_fit();
  scratch_ = ViewScratch{};
}

void PackedRows::add_figures(CacheStats& stats) const {
  std::size_t packed = 0, waiting = 0;
  for (const Head& h : heads_) {
    packed += h.packed;
    waiting += staged(h);
  }
  const double elements = 2.0 * static_cast<double>(packed + waiting) * static_cast<double>(dim_);  // K + V
  stats.figures.emplace_back("storage_bits_per_element", elements == 0 ? 0.0 : 8.0 * static_cast<double>(resident_bytes()) / elements);
  stats.figures.emplace_back("storage_staged_rows", heads_.empty() ? 0.0 : static_cast<double>(waiting) / static_cast<double>(heads_.size()));
  stats.figures.emplace_back("hi_bits", options_.hi_bits);
  stats.figures.emplace_back("lo_bits", options_.lo_bits);
  stats.figures.emplace_back("value_bits", options_.quantize_values ? options_.values_at() : 16);
}

}  // namespace kvslim
