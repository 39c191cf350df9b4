// KVCacheConfig: validation (every field, named in the error) and text access for --set.
#include "kvslim/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <variant>

#include "cache/row_scores.h"
#include "kvslim/errors.h"
#include "kvslim/methods.h"

namespace kvslim {

namespace {

using FieldPtr = std::variant<int KVCacheConfig::*, double KVCacheConfig::*, bool KVCacheConfig::*,
                              std::string KVCacheConfig::*, std::optional<int> KVCacheConfig::*>;
struct Field {
  const char* name;
  FieldPtr ptr;
};

// Every settable field, in declaration order: one table serves set() and fields().
const std::vector<Field>& field_table() {
  using C = KVCacheConfig;
  static const std::vector<Field> table = {
      {"method", &C::method},
      {"head_dim", &C::head_dim},
      {"seed", &C::seed},
      {"squeeze_budget", &C::squeeze_budget},
      {"squeeze_n_sink", &C::squeeze_n_sink},
      {"squeeze_strength", &C::squeeze_strength},
      {"squeeze_resolved_budget", &C::squeeze_resolved_budget},
      {"squeeze_prefill", &C::squeeze_prefill},
      {"squeeze_signal", &C::squeeze_signal},
      {"squeeze_concentration_heads", &C::squeeze_concentration_heads},
      {"h2o_budget", &C::h2o_budget},
      {"h2o_n_sink", &C::h2o_n_sink},
      {"pyramidkv_budget", &C::pyramidkv_budget},
      {"pyramidkv_n_sink", &C::pyramidkv_n_sink},
      {"pyramidkv_beta", &C::pyramidkv_beta},
      {"evict_profile", &C::evict_profile},
      {"evict_recent_window", &C::evict_recent_window},
      {"evict_scoring", &C::evict_scoring},
      {"evict_obs_window", &C::evict_obs_window},
      {"evict_pool_kernel", &C::evict_pool_kernel},
      {"evict_decay", &C::evict_decay},
      {"evict_cross_layer", &C::evict_cross_layer},
      {"streaming_budget", &C::streaming_budget},
      {"streaming_n_sink", &C::streaming_n_sink},
      {"zipcache_hi_bits", &C::zipcache_hi_bits},
      {"zipcache_lo_bits", &C::zipcache_lo_bits},
      {"zipcache_hi_fraction", &C::zipcache_hi_fraction},
      {"zipcache_group_size", &C::zipcache_group_size},
      {"zipcache_quantize_values", &C::zipcache_quantize_values},
      {"zipcache_value_bits", &C::zipcache_value_bits},
      {"zipcache_staging", &C::zipcache_staging},
      {"zipcache_saliency", &C::zipcache_saliency},
      {"kivi_bits", &C::kivi_bits},
      {"kivi_key_bits", &C::kivi_key_bits},
      {"kivi_value_bits", &C::kivi_value_bits},
      {"kivi_group_size", &C::kivi_group_size},
      {"kivi_staging", &C::kivi_staging},
      {"storage", &C::storage},
      {"device", &C::device},
  };
  return table;
}

[[noreturn]] void fail(std::string_view field, const std::string& value, std::string_view expected) {
  throw ConfigError("KVCacheConfig." + std::string(field) + " = " + value + ": " + std::string(expected));
}

// The shortest text that reads back as the same double (std::to_chars): `os << v` kept 6
// significant digits, so evict_decay = 0.9999999 read back, round-tripped and reported as 1
// (issue 26).
std::string str(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

void check_min(std::string_view field, int v, int lo) {
  if (v < lo) fail(field, std::to_string(v), "must be >= " + std::to_string(lo));
}
void check_range(std::string_view field, int v, int lo, int hi) {
  if (v < lo || v > hi) fail(field, std::to_string(v), "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}
void check_unit(std::string_view field, double v) {
  if (!(v >= 0.0 && v <= 1.0)) fail(field, str(v), "must be in [0, 1]");
}
template <typename Choices>
void check_choice(std::string_view field, const std::string& v, const Choices& choices) {
  std::string list;
  for (const auto& c : choices) {
    if (v == c) return;
    list += (list.empty() ? "" : ", ") + std::string(c);
  }
  fail(field, "\"" + v + "\"", "must be one of " + list);
}
void check_choice(std::string_view field, const std::string& v, std::initializer_list<const char*> choices) {
  check_choice<std::initializer_list<const char*>>(field, v, choices);
}
// A budget-limited eviction method: sinks and the protected recent window must leave room to evict.
void check_budget(std::string_view budget_name, int budget, std::string_view sink_name, int n_sink, int recent) {
  check_min(budget_name, budget, 1);
  check_min(sink_name, n_sink, 0);
  if (static_cast<long long>(n_sink) + recent >= budget) {  // in 64 bits: n_sink may be INT_MAX
    fail(budget_name, std::to_string(budget),
         "must exceed " + std::string(sink_name) + " + evict_recent_window = " + std::to_string(n_sink) + " + " +
             std::to_string(recent));
  }
}

}  // namespace

std::string_view config_field_name(int KVCacheConfig::*field) {
  for (const auto& f : field_table()) {
    const auto* p = std::get_if<int KVCacheConfig::*>(&f.ptr);
    if (p != nullptr && *p == field) return f.name;
  }
  return {};
}

void KVCacheConfig::validate() const {
  const MethodInfo& info = method_info(method);  // the registry names the known methods
  check_min("head_dim", head_dim, 1);
  check_choice("evict_profile", evict_profile, {"query_aware", "original"});
  check_min("evict_recent_window", evict_recent_window, -1);
  if (find_row_score(evict_scoring) == nullptr) {  // the built-in scorings, else a registered score
    std::string list = "auto, key_proxy, attention, attention_normalized";
    for (const RowScore& s : row_scores()) list += ", " + std::string(s.name);
    if (evict_scoring != "auto" && evict_scoring != "key_proxy" && evict_scoring != "attention" &&
        evict_scoring != "attention_normalized") {
      fail("evict_scoring", "\"" + evict_scoring + "\"", "must be one of " + list);
    }
  }
  check_min("evict_obs_window", evict_obs_window, -1);
  if (evict_pool_kernel != -1 && (evict_pool_kernel < 1 || evict_pool_kernel % 2 == 0)) {
    fail("evict_pool_kernel", std::to_string(evict_pool_kernel), "must be -1 (auto) or an odd number >= 1");
  }
  if (evict_decay != -1.0 && !(evict_decay > 0.0 && evict_decay <= 1.0)) {
    fail("evict_decay", str(evict_decay), "must be -1 (auto) or in (0, 1]");
  }
  if (evict_cross_layer != -1.0 && !(evict_cross_layer >= 0.0 && evict_cross_layer <= 1000.0)) {
    fail("evict_cross_layer", str(evict_cross_layer), "must be -1 (auto) or in [0, 1000]");
  }
  // An explicit recent window must leave room to evict; "auto" fits itself to every budget.
  const int recent = std::max(evict_recent_window, 0);

  // Every method's own fields are range-checked whatever the method, so a typo never waits until
  // the day that method is picked; cross-field rules apply to each method's own budget.
  // Every registered eviction method's budget against its sinks (and, for the chosen H2O-core
  // method, the explicit recent window).
  for (const MethodInfo& m : method_registry()) {
    if (!m.budgeted()) continue;
    check_budget(config_field_name(m.budget), this->*m.budget, config_field_name(m.n_sink), this->*m.n_sink,
                 m.h2o_core && m.name == method ? recent : 0);
  }
  check_unit("squeeze_strength", squeeze_strength);
  if (squeeze_resolved_budget) {
    check_budget("squeeze_resolved_budget", *squeeze_resolved_budget, "squeeze_n_sink", squeeze_n_sink,
                 method == "squeeze" ? recent : 0);
  }
  check_choice("squeeze_prefill", squeeze_prefill, {"deferred", "eager"});
  check_choice("squeeze_signal", squeeze_signal, {"key_dispersion", "hidden_cosine", "attention_entropy", "attention_coverage", "global_topk"});
  check_choice("squeeze_concentration_heads", squeeze_concentration_heads, {"all", "first"});
  if (!(pyramidkv_beta >= 1.0) || !std::isfinite(pyramidkv_beta)) fail("pyramidkv_beta", str(pyramidkv_beta), "must be a finite number >= 1");

  check_range("zipcache_hi_bits", zipcache_hi_bits, 1, 8);
  check_range("zipcache_lo_bits", zipcache_lo_bits, 1, 8);
  if (zipcache_lo_bits > zipcache_hi_bits) {
    fail("zipcache_lo_bits", std::to_string(zipcache_lo_bits), "must be <= zipcache_hi_bits = " + std::to_string(zipcache_hi_bits));
  }
  if (zipcache_value_bits != -1 && (zipcache_value_bits < 1 || zipcache_value_bits > 8)) {
    fail("zipcache_value_bits", std::to_string(zipcache_value_bits), "must be -1 (zipcache_hi_bits) or in [1, 8]");
  }
  check_unit("zipcache_hi_fraction", zipcache_hi_fraction);
  check_min("zipcache_group_size", zipcache_group_size, 1);
  check_min("zipcache_staging", zipcache_staging, 0);
  // The zipcache / kivi caches compress whole groups of their window; as the storage under a policy
  // (storage = zipcache / kivi) a smaller staging compresses decode rows that many at a time, in
  // a group of its own.
  // (The zipcache fields bind only a zipcache cache or storage.)
  if ((method == "zipcache" || storage == "zipcache") && zipcache_staging % zipcache_group_size != 0 &&
      !(storage == "zipcache" && zipcache_staging < zipcache_group_size)) {
    fail("zipcache_staging", std::to_string(zipcache_staging), "must be a multiple of zipcache_group_size = " + std::to_string(zipcache_group_size));
  }
  check_choice("zipcache_saliency", zipcache_saliency, {"key_norm", "attention_normalized"});
  if (kivi_bits != -1 && (kivi_bits < 1 || kivi_bits > 8)) {
    fail("kivi_bits", std::to_string(kivi_bits), "must be -1 (keys at 4 bits, values at 2) or in [1, 8]");
  }
  for (const auto& [name, v] : {std::pair{"kivi_key_bits", kivi_key_bits}, std::pair{"kivi_value_bits", kivi_value_bits}}) {
    if (v != -1 && (v < 1 || v > 8)) fail(name, std::to_string(v), "must be -1 (kivi_bits) or in [1, 8]");
  }
  check_min("kivi_group_size", kivi_group_size, 1);
  check_min("kivi_staging", kivi_staging, 0);
  if (kivi_staging % kivi_group_size != 0 && !(storage == "kivi" && kivi_staging < kivi_group_size)) {
    fail("kivi_staging", std::to_string(kivi_staging), "must be a multiple of kivi_group_size = " + std::to_string(kivi_group_size));
  }
  check_choice("storage", storage, storage_names());
  if (storage != "fp16" && info.kind == MethodKind::quantizer) {
    std::string policies;
    for (const MethodInfo& m : method_registry()) {
      if (m.kind != MethodKind::quantizer) policies += (policies.empty() ? "" : ", ") + std::string(m.name);
    }
    fail("storage", "\"" + storage + "\"",
         "applies to the eviction methods (" + policies + "); method " + method +
             " is a storage itself (method=full storage=" + method + " is the same rows under the eviction core)");
  }
  // On a CUDA device a policy keeps its rows as fp16 slots or as kivi or zipcache codes
  // (DevicePackedRows).
  if (storage != "fp16" && device != "cpu" && method == "full") {
    fail("storage", "\"" + storage + "\"",
         "must be fp16 for full on a CUDA device (device = " + device + "): method=" + storage +
             " is the same rows without a policy");
  }
  if (device_index() < -1) fail("device", "\"" + device + "\"", "must be \"cpu\", \"cuda\" or \"cuda:N\" (N >= 0)");
  // The CUDA quantizer storages (DeviceKiviCache, DeviceZipCache) read 2-, 4- or 8-bit codes in
  // groups of whole 32-row units, behind a window; zipcache's saliency is by key norm (its sets keep
  // a head's rows out of token order: no attention probabilities to score by).
  const auto device_width = [&](const char* name, int shown, int bits) {
    if (bits != 2 && bits != 4 && bits != 8) {
      fail(name, std::to_string(shown),
           "must be 2, 4 or 8 on a CUDA device (device = " + device + ": its kernels read 2-, 4- or 8-bit codes)");
    }
  };
  const auto device_groups = [&](const char* group_name, int group, const char* staging_name, int staging) {
    if (group % 32 != 0 || group > 1024) {
      fail(group_name, std::to_string(group),
           "must be a multiple of 32 up to 1024 on a CUDA device (device = " + device + ": its kernels read 32-row units)");
    }
    if (staging <= 0) {
      fail(staging_name, std::to_string(staging),
           "must be a window (a multiple of " + std::string(group_name) + ", default 128) on a CUDA device (device = " +
               device + ": every call compressed alone has no CUDA storage)");
    }
  };
  if (device != "cpu" && (method == "kivi" || storage == "kivi")) {
    device_width(kivi_key_bits == -1 ? "kivi_bits" : "kivi_key_bits", kivi_key_bits == -1 ? kivi_bits : kivi_key_bits,
                 kivi_keys_at());
    device_width(kivi_value_bits == -1 ? "kivi_bits" : "kivi_value_bits",
                 kivi_value_bits == -1 ? kivi_bits : kivi_value_bits, kivi_values_at());
    device_groups("kivi_group_size", kivi_group_size, "kivi_staging", kivi_staging);
  }
  if (device != "cpu" && (method == "zipcache" || storage == "zipcache")) {
    device_width("zipcache_hi_bits", zipcache_hi_bits, zipcache_hi_bits);
    device_width("zipcache_lo_bits", zipcache_lo_bits, zipcache_lo_bits);
    if (zipcache_value_bits != -1) device_width("zipcache_value_bits", zipcache_value_bits, zipcache_value_bits);
    device_groups("zipcache_group_size", zipcache_group_size, "zipcache_staging", zipcache_staging);
    if (zipcache_saliency != "key_norm") {
      fail("zipcache_saliency", "\"" + zipcache_saliency + "\"",
           "must be key_norm on a CUDA device (device = " + device + ": its zipcache sets are chosen by key norm; " +
               (method == "zipcache" ? "the cache keeps each head's rows out of token order, so attend reports no "
                                       "probabilities to score by)"
                                     : "the policy's scores do not choose them yet)"));
    }
    if (!zipcache_quantize_values) {
      fail("zipcache_quantize_values", "false", "must be true on a CUDA device (device = " + device + ")");
    }
  }
  if (device != "cpu" && !info.cuda) {
    std::string takes;
    for (const MethodInfo& m : method_registry()) {
      if (m.cuda) takes += (takes.empty() ? "" : ", ") + std::string(m.name);
    }
    fail("method", "\"" + method + "\"", "has no CUDA storage yet (device = " + device + " takes " + takes + ")");
  }
}

int KVCacheConfig::device_index() const {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.size() > 5 && device.compare(0, 5, "cuda:") == 0) {
    int n = -1;
    const char* first = device.data() + 5;
    const char* last = device.data() + device.size();
    const auto [ptr, ec] = std::from_chars(first, last, n);
    if (ec == std::errc() && ptr == last && n >= 0) return n;
  }
  return -2;
}

void KVCacheConfig::set(std::string_view field, std::string_view value) {
  for (const auto& f : field_table()) {
    if (field != f.name) continue;
    const std::string text(value);
    auto parse_int = [&]() {
      int v = 0;
      const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || p != text.data() + text.size() || text.empty()) fail(field, "\"" + text + "\"", "must be an integer");
      return v;
    };
    std::visit(
        [&](auto ptr) {
          using T = std::remove_reference_t<decltype(this->*ptr)>;
          if constexpr (std::is_same_v<T, int>) {
            this->*ptr = parse_int();
          } else if constexpr (std::is_same_v<T, std::optional<int>>) {
            if (text == "none" || text == "None" || text.empty()) this->*ptr = std::nullopt;
            else this->*ptr = parse_int();
          } else if constexpr (std::is_same_v<T, double>) {
            char* end = nullptr;
            const double v = std::strtod(text.c_str(), &end);
            if (text.empty() || end != text.c_str() + text.size()) fail(field, "\"" + text + "\"", "must be a number");
            this->*ptr = v;
          } else if constexpr (std::is_same_v<T, bool>) {
            if (text == "true" || text == "1" || text == "True") this->*ptr = true;
            else if (text == "false" || text == "0" || text == "False") this->*ptr = false;
            else fail(field, "\"" + text + "\"", "must be true or false");
          } else {
            this->*ptr = text;
          }
        },
        f.ptr);
    return;
  }
  std::string list;
  for (const auto& f : field_table()) list += (list.empty() ? "" : ", ") + std::string(f.name);
  throw ConfigError("KVCacheConfig has no field \"" + std::string(field) + "\"; fields: " + list);
}

std::vector<std::pair<std::string, std::string>> KVCacheConfig::fields() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& f : field_table()) {
    std::string v = std::visit(
        [&](auto ptr) -> std::string {
          using T = std::remove_cvref_t<decltype(this->*ptr)>;
          const T& x = this->*ptr;
          if constexpr (std::is_same_v<T, int>) return std::to_string(x);
          else if constexpr (std::is_same_v<T, std::optional<int>>) return x ? std::to_string(*x) : "none";
          else if constexpr (std::is_same_v<T, double>) return str(x);
          else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
          else return x;
        },
        f.ptr);
    out.emplace_back(f.name, std::move(v));
  }
  return out;
}

}  // namespace kvslim
