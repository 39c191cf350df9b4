// The method registry: one row per method, its builder beside it (kvslim/methods.h).
#include "kvslim/methods.h"

#include <string>

#include "cache/eviction_cache.h"
#include "cache/squeeze_cache.h"
#include "cache/zipcache_cache.h"
#include "kvslim/errors.h"
#include "method_table.h"
#include "storage/row_storage.h"

namespace kvslim {
namespace {

using C = KVCacheConfig;

std::unique_ptr<KVCache> build_full(const C& c, const LayerContext&) {
  EvictionPolicy p;
  p.scoring = Scoring::none;
  return std::make_unique<EvictionCache>("full", p, EvictionPolicy::kUnbounded, make_row_storage(c));
}
std::unique_ptr<KVCache> build_streaming(const C& c, const LayerContext&) {
  EvictionPolicy p;
  p.scoring = Scoring::none;
  p.n_sink = static_cast<std::size_t>(c.streaming_n_sink);
  p.recent_window = static_cast<std::size_t>(c.streaming_budget - c.streaming_n_sink);
  return std::make_unique<EvictionCache>("streaming", p, static_cast<std::size_t>(c.streaming_budget), make_row_storage(c));
}
std::unique_ptr<KVCache> build_h2o(const C& c, const LayerContext&) {
  return std::make_unique<EvictionCache>("h2o", make_eviction_policy(c, c.h2o_n_sink), static_cast<std::size_t>(c.h2o_budget),
                                         make_row_storage(c));
}
std::unique_ptr<KVCache> build_squeeze(const C& c, const LayerContext& ctx) {
  return std::make_unique<SqueezeCache>(c, ctx.coordinator, ctx.layer_id);
}
std::unique_ptr<KVCache> build_pyramidkv(const C& c, const LayerContext& ctx) {
  const int budget = ctx.budget.value_or(c.pyramidkv_budget);
  return std::make_unique<EvictionCache>("pyramidkv", make_eviction_policy(c, c.pyramidkv_n_sink),
                                         static_cast<std::size_t>(budget), make_row_storage(c));
}
std::unique_ptr<KVCache> build_zipcache(const C& c, const LayerContext&) { return make_zipcache_cache(c); }
std::unique_ptr<KVCache> build_kivi(const C& c, const LayerContext&) { return make_kivi_cache(c); }

struct Row {
  MethodInfo info;
  MethodBuilder build;
};

// THE table: every method, in the order method_names() lists them.
const std::vector<Row>& table() {
  static const std::vector<Row> rows = {
      {{"full", "plain cache: every token's fp16 (or config.storage) rows", MethodKind::dense, nullptr, nullptr, false, "",
        true},
       build_full},
      {{"streaming", "StreamingLLM: sinks + the newest tokens", MethodKind::eviction, &C::streaming_budget,
        &C::streaming_n_sink, false, "streaming_"},
       build_streaming},
      {{"h2o", "H2O-adapted: evict the least-attended tokens (the H2O core)", MethodKind::eviction, &C::h2o_budget,
        &C::h2o_n_sink, true, "h2o_", true},
       build_h2o},
      {{"squeeze", "SqueezeAttention-adapted: the H2O core under a data-driven per-layer budget", MethodKind::eviction,
        &C::squeeze_budget, &C::squeeze_n_sink, true, "squeeze_"},
       build_squeeze},
      {{"pyramidkv", "PyramidKV: the H2O core under a fixed linear per-layer taper", MethodKind::eviction,
        &C::pyramidkv_budget, &C::pyramidkv_n_sink, true, "pyramidkv_", true},
       build_pyramidkv},
      {{"zipcache", "ZipCache-adapted: per-token mixed precision (salient tokens at more bits)", MethodKind::quantizer,
        nullptr, nullptr, false, "zipcache_"},
       build_zipcache},
      {{"kivi", "KIVI-style uniform asymmetric group quantization of K and V", MethodKind::quantizer, nullptr, nullptr,
        false, "kivi_", true},
       build_kivi},
  };
  return rows;
}

std::string method_list() {
  std::string list;
  for (const Row& r : table()) list += (list.empty() ? "" : ", ") + std::string(r.info.name);
  return list;
}

const Row* find_row(std::string_view name) {
  for (const Row& r : table()) {
    if (r.info.name == name) return &r;
  }
  return nullptr;
}

}  // namespace

const std::vector<MethodInfo>& method_registry() {
  static const std::vector<MethodInfo> infos = [] {
    std::vector<MethodInfo> out;
    for (const Row& r : table()) out.push_back(r.info);
    return out;
  }();
  return infos;
}

const std::vector<std::string>& method_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const MethodInfo& m : method_registry()) out.emplace_back(m.name);
    return out;
  }();
  return names;
}

const std::vector<std::string>& storage_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out{"fp16"};
    for (const MethodInfo& m : method_registry()) {
      if (m.kind == MethodKind::quantizer) out.emplace_back(m.name);
    }
    return out;
  }();
  return names;
}

const MethodInfo* find_method(std::string_view name) {
  const Row* r = find_row(name);
  return r ? &method_registry()[static_cast<std::size_t>(r - table().data())] : nullptr;
}

const MethodInfo& method_info(std::string_view name) {
  if (const MethodInfo* m = find_method(name)) return *m;
  throw ConfigError("KVCacheConfig.method = \"" + std::string(name) + "\": must be one of " + method_list());
}

MethodBuilder method_builder(std::string_view name) {
  const Row* r = find_row(name);
  return r ? r->build : nullptr;
}

std::vector<std::string> MethodInfo::fields() const {
  std::vector<std::string> out;
  if (field_prefix.empty()) return out;
  for (const auto& [field, value] : KVCacheConfig{}.fields()) {
    if (field.compare(0, field_prefix.size(), field_prefix) == 0) out.push_back(field);
  }
  return out;
}

KVCacheConfig config_from_spec(std::string_view spec, KVCacheConfig base) {
  const std::size_t at = spec.find('@');
  base.method = std::string(spec.substr(0, at));
  if (find_method(base.method) == nullptr) {
    throw ConfigError("method spec \"" + std::string(spec) + "\": unknown method '" + base.method + "' (methods: " +
                      method_list() + ")");
  }
  for (std::size_t p = at; p != std::string_view::npos;) {
    const std::size_t next = spec.find(',', p + 1);
    const std::string_view kv = spec.substr(p + 1, next == std::string_view::npos ? std::string_view::npos : next - p - 1);
    const std::size_t eq = kv.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      throw ConfigError("method spec \"" + std::string(spec) + "\": option '" + std::string(kv) + "': expected field=value");
    }
    base.set(kv.substr(0, eq), kv.substr(eq + 1));
    p = next;
  }
  base.validate();
  return base;
}

}  // namespace kvslim
