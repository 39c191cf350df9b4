// How a cache holds its rows: the storage half of "a cache is a policy over a storage".
//
// The eviction core (cache/eviction_core.h) is the policy: it keeps each row's metadata (position,
// score, exposure) in slot order per head and decides which rows arrive and which leave. A
// RowStorage holds the keys and values of the same rows, in the same slot order, in its own form
// (fp16 slots, kivi codes, zipcache mixed precision), and feeds them to the online-softmax attention
// (attend/head_attention.h) as segments. Neither side sees the other's representation: the core
// never reads a stored row except through key_logits (the key-proxy score), the storage never
// sees a score except through settle's saliency callback.
//
// Adding a storage kind: a class implementing this interface in this folder and one branch in
// make_row_storage (storage/make_storage.cc); docs/architecture.md has the recipe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "kvslim/cache.h"

namespace kvslim {

struct KVCacheConfig;
namespace attend {
class HeadAttention;
}

class RowStorage {
 public:
  virtual ~RowStorage() = default;

  // "fp16", "kivi" or "zipcache" (KVCacheConfig::storage).
  virtual std::string_view kind() const = 0;
  // true: rows sit in slots that can be overwritten and moved one at a time (fp16): the core admits
  // a newcomer into its victim's slot and fills holes with the last rows. false: a row only arrives
  // at the end of its head (write with slot == the head's row count) and leaves by erase(), which
  // keeps the others in order (a compressed group cannot take a row in its middle).
  virtual bool slot_writes() const = 0;

  // Shape, once before the first row: heads_total = batch * kv_heads, dim = head_dim.
  virtual void begin(std::size_t heads_total, std::size_t dim) = 0;
  // The core's metadata now has room for `capacity` rows per head, of which the first `keep` are
  // valid (a slot storage allocates the same; others may give back what they hold spare).
  virtual void relayout(std::size_t capacity, std::size_t keep) = 0;
  // `incoming` rows per head are about to be written (one absorb): a storage that grows per row
  // sizes itself once here.
  virtual void prepare(std::size_t incoming) { (void)incoming; }
  // fp16 key and value [dim] into `slot` of head `head` (see slot_writes()).
  virtual void write(std::size_t head, std::size_t slot, const std::uint16_t* key, const std::uint16_t* value) = 0;
  // Slot storages: row `from` of `head` into slot `to` (the slot `from` becomes free).
  virtual void move(std::size_t head, std::size_t from, std::size_t to) = 0;
  // Other storages: the rows `slots` (ascending, distinct) of `head` leave; the others keep their
  // order. The memory they held is given back.
  virtual void erase(std::size_t head, std::span<const std::size_t> slots) = 0;
  // After a step's eviction (the rows that stay are decided): rows that waited uncompressed may be
  // compressed now. saliency(head, slot) is the policy's score of a row (zipcache's salient rows
  // by attention); `rows` = rows per head.
  using Saliency = std::function<float(std::size_t head, std::size_t slot)>;
  virtual void settle(std::size_t rows, const Saliency& saliency) {
    (void)rows;
    (void)saliency;
  }

  // logits[i] = key(head, i) . query for the first n rows of `head` (query fp32 [dim]): the
  // key-proxy score. A compressed storage decodes its keys for it (a slow path: the default
  // policies score by the engine's attention instead).
  virtual void key_logits(std::size_t head, std::size_t n, const float* query, float* logits) const = 0;
  // A slot storage's fp16 key row (the blocked key-proxy scorer reads them); nullptr otherwise.
  virtual const std::uint16_t* fp16_key(std::size_t head, std::size_t slot) const {
    (void)head;
    (void)slot;
    return nullptr;
  }

  // Feeds the first n rows of `head` to `ha` in slot order, positions pos[0..n).
  virtual void feed(attend::HeadAttention& ha, std::size_t head, const std::int64_t* pos, std::size_t n) const = 0;
  // The rows as fp16 [batch * heads, stride, dim] with their positions (the core's positions,
  // head after head `pos_stride` apart). Slot storages answer with their slots; others decode into
  // their own scratch (valid until the next non-const call).
  virtual CacheView view(std::size_t batch, std::size_t heads, std::size_t rows, const std::int64_t* positions,
                         std::size_t pos_stride) const = 0;

  // Bytes allocated for the rows (codes, group parameters, staged fp16 rows), not the metadata.
  virtual std::size_t resident_bytes() const = 0;
  // Scratch held for view() only (not part of the retained state).
  virtual std::size_t view_bytes() const { return 0; }
  virtual void reset() = 0;
  // The storage's own figures (bits per element...) for CacheStats.
  virtual void add_figures(CacheStats& stats) const { (void)stats; }
};

// The storage a config asks for (KVCacheConfig::storage with the kivi_* / zipcache_* fields).
// Throws ConfigError on an unknown kind.
std::unique_ptr<RowStorage> make_row_storage(const KVCacheConfig& config);
// fp16 slots: what every eviction method held before storages existed.
std::unique_ptr<RowStorage> make_fp16_storage();

}  // namespace kvslim
