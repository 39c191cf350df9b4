// KVCacheConfig::storage -> the storage kind, with that kind's fields (kivi_* / zipcache_*).
#include <algorithm>
#include <string>

#include "kvslim/config.h"
#include "kvslim/errors.h"
#include "storage/packed_rows.h"
#include "storage/row_storage.h"

namespace kvslim {

std::unique_ptr<RowStorage> make_row_storage(const KVCacheConfig& c) {
  if (c.storage == "fp16") return make_fp16_storage();
  PackedRowsOptions o;
  if (c.storage == "kivi") {
    o.kind = "kivi";
    o.hi_bits = o.lo_bits = c.kivi_keys_at();
    o.value_bits = c.kivi_values_at();
    o.hi_fraction = 0.0;
    o.group_size = static_cast<std::size_t>(std::max(c.kivi_group_size, 1));
    o.staging = static_cast<std::size_t>(std::max(c.kivi_staging, 0));
  } else if (c.storage == "zipcache") {
    o.kind = "zipcache";
    o.hi_bits = c.zipcache_hi_bits;
    o.lo_bits = c.zipcache_lo_bits;
    o.hi_fraction = c.zipcache_hi_fraction;
    o.group_size = static_cast<std::size_t>(std::max(c.zipcache_group_size, 1));
    o.quantize_values = c.zipcache_quantize_values;
    o.value_bits = c.zipcache_value_bits == -1 ? 0 : c.zipcache_value_bits;
    o.staging = static_cast<std::size_t>(std::max(c.zipcache_staging, 0));
    o.attention_saliency = c.zipcache_saliency == "attention_normalized";
  } else {
    throw ConfigError("KVCacheConfig.storage = \"" + c.storage + "\": must be one of fp16, kivi, zipcache");
  }
  return std::make_unique<PackedRows>(o);
}

}  // namespace kvslim
