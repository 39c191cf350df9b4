// The methods `kvslim eval` compares: a catalogue of named variants (a method plus the options
// that distinguish a documented proxy from its faithful signal), read from the method registry
// (kvslim/methods.h: each method's row carries its EvalVariants), and the memory matching that
// turns a memory level ("25% of the full cache") into each eviction method's token budget.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/attention.h"
#include "kvslim/config.h"
#include "kvslim/factory.h"

namespace kvslim::engine::eval {

struct MethodVariant {
  std::string name;         // "h2o_recent": what --methods, the table and the JSON call it
  std::string description;  // one line for the table's legend and docs
  // The proxy (variant name) a faithful variant is measured against; empty for baselines.
  std::string compares_to;
  KVCacheConfig config;     // every field but the budget (set per level and context)
  PrefillAttention prefill = PrefillAttention::cache_view;
  // evict_recent_window = fraction * budget (H2O's "recent" half); 0 = no protected window.
  double recent_window_fraction = 0;
  bool quick = false;       // part of the quick preset
  // Reconstruction scores (engine/reconstruction_score.h, KVzip's idea) for the first prefill of
  // every sequence, at this weight against the window's attention; 0 = none. Costs a second pass
  // over the context (the eval prints it).
  float reconstruction_weight = 0;

  // Eviction methods take their budget from the memory level; quantized methods sit at the bytes
  // their bits give.
  bool budgeted() const;
};

// Every variant, in the registry's eval order (kvslim::eval_variants(): baselines, then each
// method's proxy before its faithful signal, the composed policy+storage ones last).
const std::vector<MethodVariant>& variant_catalogue();
// `list`: comma-separated variant names or method ids (a method id takes all its variants); empty
// takes the preset's variants. Throws std::invalid_argument naming an unknown entry.
std::vector<MethodVariant> select_variants(const std::string& list, bool quick_preset);

// The variant's config with its method's budget field (and recent window) set. Throws
// std::invalid_argument when the budget is too small for the method's sinks + recent window.
KVCacheConfig config_with_budget(const MethodVariant& variant, int budget);

// Resident bytes of a whole CacheSet after it absorbed `context` tokens of random keys/values in
// one call, with the synthetic attention / hidden-state observations an engine would give when
// the caches ask for them. Model-free, so budgets can be matched before the model runs.
std::size_t probe_resident_bytes(const KVCacheConfig& config, const ModelSpec& spec, std::size_t context,
                                 std::uint64_t seed = 1);

// Level -> budget. A level L at context C means: the method's KV bytes right after the prefill of
// C tokens ~= L x the full cache's resident bytes at the same point. An eviction method stores a
// constant number of bytes per kept token (fp16 K and V of every KV head of every layer, plus its
// score / position bookkeeping), measured once per variant with a probe that evicts nothing; the
// budget is the target bytes over that. The bytes a method really holds (its allocation) are
// measured again in every run and reported beside the target.
class MemoryMatcher {
 public:
  explicit MemoryMatcher(ModelSpec spec);

  std::size_t full_bytes(std::size_t context) const;
  // Bytes one token costs the variant when every layer keeps it (probe at `kProbeContext`).
  double bytes_per_kept_token(const MethodVariant& variant);
  // The budget whose retained bytes at `context` are nearest level * full_bytes(context). Throws
  // std::invalid_argument when the level is outside (0, 1] or leaves no valid budget.
  int budget_for(const MethodVariant& variant, double level, std::size_t context);
  // Measures every variant's per-token bytes now, so later calls only read (thread-safe).
  void prepare(const std::vector<MethodVariant>& variants);

  static constexpr std::size_t kProbeContext = 256;

 private:
  ModelSpec spec_;
  double full_per_token_ = 0, full_intercept_ = 0;
  std::map<std::string, double> per_token_;  // per variant name
};

}  // namespace kvslim::engine::eval
