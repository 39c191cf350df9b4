// The method registry: every cache method kvslim builds, in one table (src/kvslim/methods.cc).
// The config's validation, the factory, the CLI (--method, --set), `kvslim eval`'s memory
// matching, the benchmarks and Python (kvslim.methods(), kvslim.method_info()) read it; a method
// name appears nowhere else as a rule. Adding a method = one row there (its builder beside it).
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "kvslim/config.h"

namespace kvslim {

enum class MethodKind {
  dense,      // keeps every token (full)
  eviction,   // keeps a token budget per head (a policy over KVCacheConfig::storage)
  quantizer,  // keeps every token, compressed (also a storage kind under an eviction method)
};

struct MethodInfo {
  std::string_view name;     // KVCacheConfig::method
  std::string_view summary;  // one line for --help, docs and Python
  MethodKind kind = MethodKind::dense;
  // Eviction methods: the config fields holding the budget (average tokens per head per layer)
  // and the protected leading positions; nullptr for the others.
  int KVCacheConfig::*budget = nullptr;
  int KVCacheConfig::*n_sink = nullptr;
  // Scored by the H2O core (the evict_* fields apply, cross-layer importance is shared).
  bool h2o_core = false;
  // Its own config fields are those starting with this prefix (empty: none).
  std::string_view field_prefix;
  // Built on a CUDA device too (KVCacheConfig::device; kvslim/cuda.h).
  bool cuda = false;

  bool budgeted() const { return budget != nullptr; }
  // Its own fields, in declaration order (KVCacheConfig::fields() names).
  std::vector<std::string> fields() const;
};

// Every method, in the registry's order (method_names() is their names).
const std::vector<MethodInfo>& method_registry();
// nullptr when no method has this name.
const MethodInfo* find_method(std::string_view name);
// The method's row; throws ConfigError naming the known methods when there is none.
const MethodInfo& method_info(std::string_view name);
// The storage kinds an eviction method's rows may be held in (KVCacheConfig::storage): "fp16"
// and every quantizer.
const std::vector<std::string>& storage_names();

// The name of an int field of KVCacheConfig ("h2o_budget" for &KVCacheConfig::h2o_budget), as
// set() and fields() spell it; empty when the pointer names no settable field.
std::string_view config_field_name(int KVCacheConfig::*field);

// One name for a configured method, everywhere a method is named with options (bench engine's
// --method, the CLI's variants): "METHOD" or "METHOD@field=value,field=value" -- `base` with
// the method set, then each field set (KVCacheConfig::set), then validated. Throws ConfigError
// on an unknown method or field, or a bad value.
KVCacheConfig config_from_spec(std::string_view spec, KVCacheConfig base = {});

}  // namespace kvslim
