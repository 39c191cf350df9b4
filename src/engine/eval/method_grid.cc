#include "engine/eval/method_grid.h"

#include "kvslim/squeeze.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "kvslim/cache.h"
#include "kvslim/methods.h"

namespace kvslim::engine::eval {
namespace {

// The registry's eval variants (kvslim/methods.h: each method's row carries its own), in its order.
std::vector<MethodVariant> build_catalogue() {
  std::vector<MethodVariant> all;
  for (const EvalVariant* e : eval_variants()) {
    MethodVariant v;
    v.name = std::string(e->name);
    v.description = std::string(e->description);
    v.compares_to = std::string(e->compares_to);
    v.config = e->config();
    v.recent_window_fraction = e->recent_window_fraction;
    v.quick = e->quick;
    v.reconstruction_weight = e->reconstruction_weight;
    v.prefill = e->prefill_full_prompt ? PrefillAttention::full_prompt : PrefillAttention::cache_view;
    all.push_back(std::move(v));
  }
  return all;
}

// The method's budget and sink fields, from the registry (kvslim/methods.h).
int* budget_field(KVCacheConfig& c) {
  const MethodInfo& m = method_info(c.method);
  return m.budgeted() ? &(c.*m.budget) : nullptr;
}

int sinks(const KVCacheConfig& c) {
  const MethodInfo& m = method_info(c.method);
  return m.n_sink != nullptr ? c.*m.n_sink : 0;
}

// The smallest budget the variant accepts (sinks + recent window + 1).
int min_budget(const MethodVariant& v) {
  const int n_sink = sinks(v.config);
  int b = n_sink + 1;
  while (n_sink + static_cast<int>(std::floor(v.recent_window_fraction * b)) >= b) ++b;
  return b;
}

}  // namespace

bool MethodVariant::budgeted() const {
  KVCacheConfig c = config;
  return budget_field(c) != nullptr;
}

const std::vector<MethodVariant>& variant_catalogue() {
  static const std::vector<MethodVariant> catalogue = build_catalogue();
  return catalogue;
}

std::vector<MethodVariant> select_variants(const std::string& list, bool quick_preset) {
  const auto& all = variant_catalogue();
  std::vector<MethodVariant> out;
  if (list.empty()) {
    for (const auto& v : all) {
      if (!quick_preset || v.quick) out.push_back(v);
    }
    return out;
  }
  std::vector<bool> taken(all.size(), false);
  std::stringstream in(list);
  std::string item;
  bool named_any = false;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    named_any = named_any || !item.empty();
    const MethodInfo* id = find_method(item);
    if (item.empty() || (id != nullptr && id->kind == MethodKind::dense)) continue;  // full is always the reference
    bool matched = false;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (all[i].name == item) {
        taken[i] = matched = true;
      }
    }
    if (!matched) {  // a method id: all its variants over fp16 rows (a composed one goes by its name)
      for (std::size_t i = 0; i < all.size(); ++i) {
        if (all[i].config.method == item && all[i].config.storage == "fp16") taken[i] = matched = true;
      }
    }
    if (!matched) {
      std::string names, ids;
      for (const auto& v : all) names += (names.empty() ? "" : ", ") + v.name;
      for (const MethodInfo& m : method_registry()) {
        if (m.kind != MethodKind::dense) ids += (ids.empty() ? "" : ", ") + std::string(m.name);
      }
      throw std::invalid_argument("--methods: unknown method or variant \"" + item + "\" (variants: " + names +
                                  "; or a method id: " + ids + ")");
    }
  }
  // "," or " , " names nothing: an evaluation of nothing that exits 0 hides the typo.
  if (!named_any) throw std::invalid_argument("--methods \"" + list + "\": names no method or variant");
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (taken[i]) out.push_back(all[i]);
  }
  return out;
}

KVCacheConfig config_with_budget(const MethodVariant& variant, int budget) {
  KVCacheConfig c = variant.config;
  int* field = budget_field(c);
  if (field == nullptr) return c;
  if (budget < min_budget(variant)) {
    throw std::invalid_argument("variant " + variant.name + ": budget " + std::to_string(budget) +
                                " is below its minimum " + std::to_string(min_budget(variant)) +
                                " (sinks + recent window + 1); use a larger --levels value or a longer context");
  }
  *field = budget;
  if (variant.recent_window_fraction > 0) {
    c.evict_recent_window = static_cast<int>(std::floor(variant.recent_window_fraction * budget));
  }
  c.validate();
  return c;
}

std::size_t probe_resident_bytes(const KVCacheConfig& config, const ModelSpec& spec, std::size_t context,
                                 std::uint64_t seed) {
  if (context == 0) throw std::invalid_argument("probe_resident_bytes: context must be >= 1");
  CacheSet caches = KVCacheBuilder::for_model(spec, config);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.05f, 1.0f);
  std::vector<std::int64_t> positions(context);
  for (std::size_t i = 0; i < context; ++i) positions[i] = static_cast<std::int64_t>(i);
  constexpr std::size_t kHidden = 64;
  std::vector<float> keys, values, probs;
  std::vector<float> before(context * kHidden), after(context * kHidden);  // [1, S, hidden]
  for (std::size_t l = 0; l < caches.size(); ++l) {
    KVCache* cache = caches[l];
    if (cache == nullptr) continue;
    const LayerSpec& ls = spec.layers[l];
    const std::size_t heads = static_cast<std::size_t>(ls.kv_heads), dim = static_cast<std::size_t>(ls.head_dim);
    keys.resize(heads * context * dim);  // [1, H_kv, S, D]
    values.resize(keys.size());
    for (auto& x : keys) x = normal(rng);
    for (auto& x : values) x = normal(rng);
    const CacheView view = cache->update_and_fetch(make_block(keys.data(), 1, heads, context, dim),
                                                   make_block(values.data(), 1, heads, context, dim), positions);
    if (cache->needs().attention) {
      // Random positive weights over the rows each query could see, normalised per query and
      // summed over a KV group of two query heads: [H_kv, S, rows].
      probs.assign(heads * context * view.tokens, 0.0f);
      for (std::size_t h = 0; h < heads; ++h) {
        for (std::size_t q = 0; q < context; ++q) {
          float* row = probs.data() + (h * context + q) * view.tokens;
          double sum = 0;
          for (std::size_t i = 0; i < view.tokens; ++i) {
            if (view.position(0, h, i) <= positions[q]) sum += (row[i] = uniform(rng));
          }
          if (sum > 0) {
            for (std::size_t i = 0; i < view.tokens; ++i) row[i] = static_cast<float>(2.0 * row[i] / sum);
          }
        }
      }
      cache->observe_attention(AttentionObservation{probs.data(), 1, heads, context, view.tokens, view.tokens, positions});
    }
    if (cache->needs().hidden_states) {
      for (auto& x : before) x = normal(rng);
      for (std::size_t i = 0; i < after.size(); ++i) after[i] = before[i] + 0.5f * normal(rng);
      cache->observe_hidden(HiddenObservation{before.data(), after.data(), 1, context, kHidden});
    }
  }
  // Squeeze layers adopt the schedule the last layer finalised at their own next call (the
  // threading rule in kvslim/cache.h): one decode token settles a layer still above its budget.
  if (const SqueezeCoordinator* coordinator = caches.coordinator()) {
    const std::vector<std::int64_t> next{static_cast<std::int64_t>(context)};
    for (std::size_t l = 0; l < caches.size(); ++l) {
      KVCache* cache = caches[l];
      const auto budget = coordinator->resolved_budget(static_cast<int>(l));
      if (cache == nullptr || !budget || cache->rows() <= static_cast<std::size_t>(*budget)) continue;
      const std::size_t heads = static_cast<std::size_t>(spec.layers[l].kv_heads), dim = static_cast<std::size_t>(spec.layers[l].head_dim);
      keys.assign(heads * dim, 0.5f);
      cache->append(make_block(keys.data(), 1, heads, 1, dim), make_block(keys.data(), 1, heads, 1, dim), next);
    }
  }
  return caches.resident_bytes();
}

MemoryMatcher::MemoryMatcher(ModelSpec spec) : spec_(std::move(spec)) {
  KVCacheConfig full;
  full.method = "full";
  const double a = static_cast<double>(probe_resident_bytes(full, spec_, 64));
  const double b = static_cast<double>(probe_resident_bytes(full, spec_, 192));
  full_per_token_ = (b - a) / 128.0;
  full_intercept_ = a - 64.0 * full_per_token_;
  if (!(full_per_token_ > 0)) throw std::invalid_argument("MemoryMatcher: the model spec has no attention layer");
}

std::size_t MemoryMatcher::full_bytes(std::size_t context) const {
  return static_cast<std::size_t>(std::llround(full_intercept_ + full_per_token_ * static_cast<double>(context)));
}

double MemoryMatcher::bytes_per_kept_token(const MethodVariant& variant) {
  const auto it = per_token_.find(variant.name);
  if (it != per_token_.end()) return it->second;
  if (!variant.budgeted()) throw std::invalid_argument("variant " + variant.name + " has no token budget to match");
  // A budget above the probe context: nothing is evicted, every layer keeps every token (a squeeze
  // layer's schedule cannot push it below the context either: its floor is the average budget's
  // share, and the whole set is sized by the average).
  const int budget = static_cast<int>(kProbeContext) * static_cast<int>(std::max<std::size_t>(spec_.layers.size(), 1)) * 2;
  const double bytes = static_cast<double>(probe_resident_bytes(config_with_budget(variant, budget), spec_, kProbeContext));
  double per_token = bytes / static_cast<double>(kProbeContext);
  if (!(per_token > 0)) throw std::logic_error("variant " + variant.name + ": the probe holds no bytes");
  // A per-layer schedule (pyramidkv's taper) can hold more than average x layers: a second probe
  // that evicts measures the factor. A cache whose allocation does not follow its budget at all
  // (it keeps the prefill's rows allocated) gives a factor far above 1 and is matched on kept
  // tokens alone; the run reports its real allocation.
  // The factor is the schedule's, so it is measured over fp16 rows: a compressed storage's short
  // last group (64 kept rows in groups of 128) would read as a schedule and overcharge every row.
  const int evicting = static_cast<int>(kProbeContext / 4);
  MethodVariant rows = variant;
  rows.config.storage = "fp16";
  rows.config.kivi_staging = rows.config.kivi_group_size;  // (the storage's fields, idle over fp16)
  rows.config.zipcache_staging = rows.config.zipcache_group_size;
  const double rows_per_token =
      rows.config.storage == variant.config.storage
          ? per_token
          : static_cast<double>(probe_resident_bytes(config_with_budget(rows, budget), spec_, kProbeContext)) / static_cast<double>(kProbeContext);
  const double held = static_cast<double>(probe_resident_bytes(config_with_budget(rows, evicting), spec_, kProbeContext));
  const double factor = held / (rows_per_token * evicting);
  if (factor > 1.0 && factor < 1.5) per_token *= factor;
  return per_token_[variant.name] = per_token;
}

void MemoryMatcher::prepare(const std::vector<MethodVariant>& variants) {
  for (const auto& v : variants) {
    if (v.budgeted()) bytes_per_kept_token(v);
  }
}

int MemoryMatcher::budget_for(const MethodVariant& variant, double level, std::size_t context) {
  if (!(level > 0.0 && level <= 1.0)) {
    throw std::invalid_argument("memory level " + std::to_string(level) + " must be in (0, 1]");
  }
  const double target = level * static_cast<double>(full_bytes(context));
  const int budget = static_cast<int>(std::lround(target / bytes_per_kept_token(variant)));
  if (budget < min_budget(variant)) {
    throw std::invalid_argument("variant " + variant.name + ": level " + std::to_string(level) + " at context " +
                                std::to_string(context) + " leaves a budget of " + std::to_string(budget) +
                                " tokens, below its minimum " + std::to_string(min_budget(variant)));
  }
  return budget;
}

}  // namespace kvslim::engine::eval
