// The method registry: every cache method kvslim builds, in one table (src/kvslim/methods.cc),
// each row with the variants `kvslim eval` compares. The config's validation, the factory, the CLI
// (--method, --set), `kvslim eval` (its catalogue and memory matching), the benchmarks and Python
// (kvslim.methods(), kvslim.method_info(), Config.from_spec()) read it; a method name appears
// nowhere else as a rule. Adding a method = one row there (its builder beside it).
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

// One variant `kvslim eval` compares (engine/eval/method_grid.h reads them): its method (the row it
// sits in) with some fields set. Its name is also a spec (config_from_spec: `bench attend --cache
// kivi4`, `bench engine --method squeeze_s1`, Python's Config.from_spec) unless it carries
// eval-only data (a recent window proportional to the budget, reconstruction scores).
struct EvalVariant {
  std::string_view name;         // "h2o_recent": what --methods, the table and the JSON call it
  std::string_view description;  // one line for `kvslim eval --list-methods` and the JSON
  // The fields it sets over the config's defaults, as a spec's options: "field=value,field=value"
  // (KVCacheConfig::set); empty: the method at its defaults. A field the name promises is set
  // even when it is the default (kivi2: kivi_bits=2), so the name holds if a default moves.
  std::string_view settings;
  std::string_view compares_to;  // the variant of the same method it is measured against; empty for baselines
  bool quick = false;            // joins the quick preset (every variant joins the full one)
  // Equal-bytes placement: evict_recent_window = this fraction of the budget a memory level
  // gives (H2O's "recent" half); 0 = the profile's own window.
  double recent_window_fraction = 0;
  // Reconstruction scores (KVzip-style second pass over the context, computed by kvslim eval's
  // engine) for the first prefill of every sequence, at this weight against the window's
  // attention; 0 = none.
  float reconstruction_weight = 0;
  // kvslim eval's engine attends a prompt over the previous view plus the call's own rows (as
  // computed, fp16) and only then lets the cache absorb them (engine PrefillAttention::full_prompt:
  // KIVI's, ZipCache's and kvpress's order), instead of over what the cache kept of them.
  bool prefill_full_prompt = false;
  std::string_view method;  // its row's name (filled by the registry)

  // Data only kvslim eval can apply (not part of the config).
  bool eval_only() const { return recent_window_fraction != 0 || reconstruction_weight != 0 || prefill_full_prompt; }
  // Its method over a storage other than fp16 (named policy+storage); `kvslim eval` lists these
  // after every variant over fp16 rows.
  bool composed() const;
  // The config: the method, then `settings` (validated). Throws ConfigError on a bad setting.
  KVCacheConfig config() const;
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
  // kvslim eval's variants of this method, in the order its table lists them.
  std::vector<EvalVariant> variants;
  // Where the method's variants sit in kvslim eval's table: ascending, ties in the registry's
  // order (the published tables list kivi's before zipcache's).
  int eval_rank = 0;

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
// Every eval variant, in the order `kvslim eval` lists them: variants over fp16 rows by their
// method's eval_rank (then registry order), then the composed ones (policy+storage) by their
// policy's; within a method, its row's order.
const std::vector<const EvalVariant*>& eval_variants();
// nullptr when no variant has this name.
const EvalVariant* find_variant(std::string_view name);
// The storage kinds an eviction method's rows may be held in (KVCacheConfig::storage): "fp16"
// and every quantizer.
const std::vector<std::string>& storage_names();

// The name of an int field of KVCacheConfig ("h2o_budget" for &KVCacheConfig::h2o_budget), as
// set() and fields() spell it; empty when the pointer names no settable field.
std::string_view config_field_name(int KVCacheConfig::*field);

// One name for a configured method, everywhere a method is named with options (bench engine's
// --method, bench attend's --cache, Python's Config.from_spec): "NAME" or
// "NAME@field=value,field=value", NAME a method or an eval variant (kivi4, squeeze_s1) -- `base`
// with the method set (and the variant's settings), then each field set (KVCacheConfig::set),
// then validated. Throws ConfigError on an unknown name or field, a bad value, or a variant whose
// eval-only data a config cannot hold (EvalVariant::eval_only).
KVCacheConfig config_from_spec(std::string_view spec, KVCacheConfig base = {});

}  // namespace kvslim
