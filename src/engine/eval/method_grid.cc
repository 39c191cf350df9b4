#include "engine/eval/method_grid.h"

#include "kvslim/squeeze.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>

#include "kvslim/cache.h"
#include "kvslim/methods.h"

namespace kvslim::engine::eval {
namespace {

MethodVariant make(std::string name, std::string method, std::string description, bool quick) {
  MethodVariant v;
  v.name = std::move(name);
  v.description = std::move(description);
  v.config.method = std::move(method);
  v.quick = quick;
  return v;
}

std::vector<MethodVariant> build_catalogue() {
  std::vector<MethodVariant> all;
  all.push_back(make("streaming", "streaming", "StreamingLLM: 4 sinks + the newest tokens", true));

  // The H2O-core methods at their defaults (evict_profile = query_aware), then the documented
  // behaviour (evict_profile = original) and the variants that chose the defaults.
  auto original = [](MethodVariant v) {
    v.config.evict_profile = "original";
    return v;
  };
  all.push_back(make("h2o", "h2o", "H2O at its default: SnapKV-style prefill (last 16 queries, pool 15) with cross-layer importance, normalised attention, recent window", true));
  {
    auto v = make("h2o_nopool", "h2o", "h2o default without the prefill pooling (kernel 1)", false);
    v.config.evict_pool_kernel = 1;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  {
    auto v = make("h2o_nowindow", "h2o", "h2o default without the observation window (every prompt query scores)", false);
    v.config.evict_obs_window = 0;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  // The prefill's observation window and pooling around the default (16, 15), which is h2o_w16_p15.
  for (auto [w, pool] : {std::pair{8, 15}, std::pair{16, 15}, std::pair{4, 15}, std::pair{8, 7}, std::pair{8, 31}}) {
    auto v = make("h2o_w" + std::to_string(w) + "_p" + std::to_string(pool), "h2o",
                  "h2o default with an observation window of " + std::to_string(w) + " queries and pooling over " +
                      std::to_string(pool) + " positions",
                  false);
    v.config.evict_obs_window = w;
    v.config.evict_pool_kernel = pool;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  {
    auto v = make("h2o_value_norm", "h2o", "h2o default scored by normalised attention x the value's L1 norm (VATP; evict_scoring=value_norm_attention)", false);
    v.config.evict_scoring = "value_norm_attention";
    v.compares_to = "h2o";
    all.push_back(v);
  }
  {
    auto v = make("h2o_sum_decay", "h2o", "h2o default, raw attention sum with decay 0.98 instead of normalisation", false);
    v.config.evict_scoring = "attention";
    v.config.evict_decay = 0.98;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  // Cross-layer importance (default weight 0.1): off, and the weights around it.
  for (auto [suffix, weight] : {std::pair{"nocross", 0.0}, std::pair{"cross0.01", 0.01}, std::pair{"cross0.03", 0.03},
                                std::pair{"cross0.3", 0.3}, std::pair{"cross1", 1.0}}) {
    auto v = make(std::string("h2o_") + suffix, "h2o",
                  weight == 0.0 ? std::string("h2o default with each layer scoring alone (evict_cross_layer 0)")
                                : "h2o default with the other layers' prefill attention at weight " + std::string(suffix + 5) +
                                      " (evict_cross_layer)",
                  false);
    v.config.evict_cross_layer = weight;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  // Wider observation windows (issue 27): with the question after the context the prompt's last
  // 16 queries are the document's end, not the question; more of the document's queries score it.
  for (int w : {64, 256}) {
    auto v = make("h2o_w" + std::to_string(w) + "_p15", "h2o",
                  "h2o default with an observation window of " + std::to_string(w) + " queries (pool 15)", false);
    v.config.evict_obs_window = w;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  // Reconstruction scores (issue 27, KVzip's idea): the model re-reads the context after a repeat
  // prompt and each token is scored by the attention the copy gives it; query-agnostic, so it
  // holds when the question comes after the context. Weight 1: added to the window's attention;
  // 100: the reconstruction decides.
  for (auto [suffix, weight] : {std::pair{"", 1.0f}, std::pair{"_only", 100.0f}}) {
    auto v = make(std::string("h2o_kvzip") + suffix, "h2o",
                  std::string("h2o default with reconstruction scores (KVzip-style second pass over the context)") +
                      (weight > 1 ? ", the reconstruction deciding" : ", added to the window's"),
                  false);
    v.reconstruction_weight = weight;
    v.compares_to = "h2o";
    all.push_back(v);
  }
  all.push_back(original(make("h2o_original", "h2o", "H2O, documented key-proxy score, no recent window (evict_profile=original)", true)));
  {
    auto v = original(make("h2o_recent", "h2o", "H2O key proxy, newest half of the budget protected", false));
    v.recent_window_fraction = 0.5;
    all.push_back(v);
  }
  {
    auto v = original(make("h2o_attn_norm", "h2o", "H2O scored by accumulated attention / queries that could see the token, no window", false));
    v.config.evict_scoring = "attention_normalized";
    v.compares_to = "h2o_original";
    all.push_back(v);
  }

  for (double s : {0.5, 1.0}) {
    std::ostringstream name;
    name << "squeeze_s" << s;
    auto v = make(name.str(), "squeeze", "SqueezeAttention budgets (key dispersion) over the default h2o scorer, strength " +
                                             name.str().substr(9), s == 1.0);
    v.config.squeeze_strength = s;
    v.config.squeeze_signal = "key_dispersion";
    all.push_back(v);
  }
  {
    auto v = make("squeeze_s1_hidden", "squeeze", "squeeze strength 1, layer signal = hidden-state cosine (the paper's)", false);
    v.config.squeeze_signal = "hidden_cosine";
    v.compares_to = "squeeze_s1";
    all.push_back(v);
  }
  for (double s : {0.5, 1.0}) {
    std::ostringstream name;
    name << "squeeze_entropy_s" << s;
    auto v = make(name.str(), "squeeze", "squeeze, layer signal = attention entropy of the prompt's last queries, strength " +
                                             name.str().substr(17), s == 1.0);
    v.config.squeeze_strength = s;
    v.config.squeeze_signal = "attention_entropy";
    v.compares_to = "squeeze_s1";
    all.push_back(v);
  }
  for (double s : {0.5, 1.0}) {
    std::ostringstream name;
    name << "squeeze_coverage_s" << s;
    auto v = make(name.str(), "squeeze", "squeeze, layer signal = attention mass the top average-budget tokens hold, strength " +
                                             name.str().substr(18), false);
    v.config.squeeze_strength = s;
    v.config.squeeze_signal = "attention_coverage";
    v.compares_to = "squeeze_s1";
    all.push_back(v);
  }
  for (double s : {0.5, 1.0}) {
    std::ostringstream name;
    name << "squeeze_global_s" << s;
    auto v = make(name.str(), "squeeze", "squeeze, budgets from a global top-k of every layer's token scores (KVzip-style), strength " +
                                             name.str().substr(16), false);
    v.config.squeeze_strength = s;
    v.config.squeeze_signal = "global_topk";
    v.compares_to = "squeeze_s1";
    all.push_back(v);
  }
  {
    auto v = make("squeeze_s1_nocross", "squeeze", "squeeze_s1 with each layer scoring alone (evict_cross_layer 0)", false);
    v.config.squeeze_signal = "key_dispersion";
    v.config.evict_cross_layer = 0.0;
    v.compares_to = "squeeze_s1";
    all.push_back(v);
  }
  {
    auto v = original(make("squeeze_original", "squeeze", "squeeze strength 1, key dispersion, documented H2O core (evict_profile=original)", false));
    v.config.squeeze_signal = "key_dispersion";
    all.push_back(v);
  }
  {
    auto v = original(make("squeeze_original_eager", "squeeze", "squeeze_original with the documented eager prefill order", false));
    v.config.squeeze_signal = "key_dispersion";
    v.config.squeeze_prefill = "eager";
    v.compares_to = "squeeze_original";
    all.push_back(v);
  }
  all.push_back(make("pyramidkv", "pyramidkv", "PyramidKV: default h2o scorer with a fixed linear per-layer taper (beta 1.25: layer 0 at 1.2x the average, the last at 0.8x)", true));
  for (double beta : {1.5, 2.0, 5.0, 20.0}) {
    std::ostringstream name;
    name << beta;
    const std::string b = name.str();
    auto v = make("pyramidkv_b" + b, "pyramidkv",
                  "pyramidkv with a steeper taper (beta " + b +
                      ": last layer avg/" + b + (beta == 20.0 ? ", kvpress's)" : ")"),
                  false);
    v.config.pyramidkv_beta = beta;
    v.compares_to = "pyramidkv";
    all.push_back(v);
  }
  {
    auto v = make("pyramidkv_nocross", "pyramidkv", "pyramidkv default with each layer scoring alone (evict_cross_layer 0)", false);
    v.config.evict_cross_layer = 0.0;
    v.compares_to = "pyramidkv";
    all.push_back(v);
  }
  {
    auto v = original(make("pyramidkv_original", "pyramidkv", "PyramidKV (beta 20) over the documented key-proxy core", false));
    v.config.pyramidkv_beta = 20.0;
    all.push_back(v);
  }

  for (int bits : {2, 4}) {
    auto v = make("kivi" + std::to_string(bits), "kivi",
                  "uniform " + std::to_string(bits) + "-bit group quantization of K and V (KIVI-style, group 32, 128 fp16 staging)",
                  true);
    v.config.kivi_bits = bits;
    all.push_back(v);
  }
  // Fewer bits with larger groups (issue 27: kivi's default bits re-chosen with kvlist in view;
  // 2-bit values lose 5-digit numbers): 3 and 4 bits at groups of 64 / 128 rows sit at 22-28 %
  // of the full cache's bytes, where 2-bit group-32 sits at 19 %.
  struct Kivi {
    int bits, group;
  };
  for (const Kivi& k : {Kivi{3, 32}, Kivi{3, 64}, Kivi{3, 128}, Kivi{4, 128}, Kivi{2, 128}}) {
    auto v = make("kivi" + std::to_string(k.bits) + "_g" + std::to_string(k.group), "kivi",
                  "uniform " + std::to_string(k.bits) + "-bit group quantization of K and V, groups of " +
                      std::to_string(k.group) + " rows (128 fp16 staging)",
                  false);
    v.config.kivi_bits = k.bits;
    v.config.kivi_group_size = k.group;
    v.config.kivi_staging = std::max(128, k.group);
    all.push_back(v);
  }
  struct Zip {
    int hi, lo;
    double frac;
    bool quick;
  };
  for (const Zip& z : {Zip{4, 2, 0.2, true}, Zip{4, 2, 0.5, false}, Zip{8, 4, 0.2, false}, Zip{4, 1, 0.2, false}, Zip{4, 3, 0.2, false}}) {
    const int pct = static_cast<int>(std::lround(z.frac * 100));
    auto v = make("zipcache_" + std::to_string(z.hi) + "_" + std::to_string(z.lo) + "_h" + std::to_string(pct), "zipcache",
                  "ZipCache: " + std::to_string(pct) + "% salient tokens at " + std::to_string(z.hi) + " bits, the rest at " +
                      std::to_string(z.lo) + " (key-norm saliency)",
                  z.quick);
    v.config.zipcache_hi_bits = z.hi;
    v.config.zipcache_lo_bits = z.lo;
    v.config.zipcache_hi_fraction = z.frac;
    all.push_back(v);
  }
  {
    auto v = make("zipcache_4_2_h20_attn", "zipcache", "ZipCache 4/2 bits, 20% salient by normalised attention (the paper's)", false);
    v.config.zipcache_saliency = "attention_normalized";
    v.compares_to = "zipcache_4_2_h20";
    all.push_back(v);
  }
  // A policy over a compressed storage (KVCacheConfig::storage), named policy+storage: matched to
  // the same bytes as every eviction variant (the probe measures what a kept token costs in that
  // storage). Staging = one group (g64: 16 rows), so at most that many - 1 kept rows wait in fp16.
  struct Composed {
    const char* policy;
    const char* storage;
    int bits;
    bool attention_saliency;
    int group = 32;
    int staging = 32;  // decode rows compressed this many at a time
  };
  for (const Composed& m : {Composed{"h2o", "kivi", 4, false}, Composed{"h2o", "kivi", 2, false},
                            Composed{"squeeze", "kivi", 4, false}, Composed{"pyramidkv", "kivi", 4, false},
                            Composed{"h2o", "zipcache", 0, true}, Composed{"squeeze", "zipcache", 0, true},
                            Composed{"h2o", "kivi", 4, false, 64, 16}, Composed{"squeeze", "kivi", 4, false, 64, 16},
                            // 3 bits, the fewest that keep kvlist's 5-digit values (issue 27): about
                            // 55-60 % of the tokens at 12.5 % of the full cache's bytes.
                            Composed{"h2o", "kivi", 3, false, 64, 16}, Composed{"squeeze", "kivi", 3, false, 64, 16},
                            Composed{"pyramidkv", "kivi", 3, false, 64, 16}, Composed{"h2o", "kivi", 3, false, 128, 16},
                            Composed{"squeeze", "kivi", 3, false, 128, 16}}) {
    const std::string g = m.group == 32 ? "" : "_g" + std::to_string(m.group);
    const std::string storage = std::string(m.storage) == "kivi" ? "kivi" + std::to_string(m.bits) + g : std::string("zipcache");
    const std::string what = std::string(m.storage) == "kivi"
                                 ? "uniform " + std::to_string(m.bits) + "-bit groups of " + std::to_string(m.group) + " rows" +
                                       (m.staging < m.group ? ", decode rows " + std::to_string(m.staging) + " at a time" : "")
                                 : std::string("zipcache 4/2 bits, 20% salient by the policy's normalised attention");
    auto v = make(std::string(m.policy) + "+" + storage, m.policy,
                  std::string(m.policy) + " at its default over " + what + " (storage=" + m.storage + ")", false);
    if (std::string(m.policy) == "squeeze") v.config.squeeze_signal = "key_dispersion";
    v.config.storage = m.storage;
    v.config.kivi_bits = m.bits == 0 ? v.config.kivi_bits : m.bits;
    v.config.kivi_group_size = m.group;
    v.config.kivi_staging = m.staging < m.group ? m.staging : m.group;
    v.config.zipcache_staging = v.config.zipcache_group_size;
    if (m.attention_saliency) v.config.zipcache_saliency = "attention_normalized";
    all.push_back(v);
  }
  for (const auto& v : all) v.config.validate();
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
