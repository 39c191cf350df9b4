// KVCacheConfig: one flat configuration, with the original system's field names and defaults,
// plus kvslim's own options (each documented here and in docs/methods.md).
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvslim {

// Method ids, in the order of the method registry (kvslim/methods.h: each method's row says what
// it is, its budget and sink fields and its own fields).
const std::vector<std::string>& method_names();

struct KVCacheConfig {
  std::string method = "full";
  int head_dim = 128;  // overridden per layer by for_model; caches take D from the blocks they get
  int seed = 42;       // for_model sets seed + layer index; no method draws random numbers yet

  // --- squeeze (SqueezeAttention-adapted) ---
  int squeeze_budget = 512;   // average per-layer budget (tokens per head)
  int squeeze_n_sink = 4;     // leading positions never evicted; budget floor is n_sink + 1
  double squeeze_strength = 1.0;  // 0 = uniform (== h2o), 1 = full inverse-concentration split
  std::optional<int> squeeze_resolved_budget;  // explicit per-layer budget (single cache / tests)
  // "deferred" (default): during the first call a layer evicts only against the largest budget the
  // schedule could give it, and every layer is trimmed to its resolved budget the moment the
  // coordinator finalises. "eager": the documented order (evict to the average until finalised,
  // adopt and trim at the next call) -- reproduces the original benchmark's kept counts.
  std::string squeeze_prefill = "deferred";
  // Layer signal: "key_dispersion" (documented proxy: mean off-diagonal key cosine) or
  // "hidden_cosine" (the paper's: cosine between hidden states before and after attention; needs
  // an engine that reports hidden states through the observation hook) or "attention_entropy"
  // (1 - the normalised entropy of the attention of the prompt's last queries, observed during the
  // first call; needs an engine that reports attention) or "attention_coverage" (the share of
  // those queries' attention mass that the layer's top squeeze_budget tokens hold) or
  // "global_topk" (KVzip-style: no per-layer signal; one threshold over the token scores of every
  // layer after the first call, so each layer keeps its share of the model-wide top tokens).
  std::string squeeze_signal = "key_dispersion";
  // Which heads of the first call the key-dispersion proxy averages: "all" (kvslim default: mean
  // over every (batch, head)) or "first" (the original: batch 0, head 0 only).
  std::string squeeze_concentration_heads = "all";

  // --- h2o (H2O-adapted, original 0.21.0 semantics) ---
  int h2o_budget = 512;  // max tokens kept per head
  int h2o_n_sink = 4;    // leading positions protected

  // --- pyramidkv (H2O with a fixed linear taper; kvpress's schedule) ---
  int pyramidkv_budget = 512;   // average per-layer budget
  int pyramidkv_n_sink = 4;
  // Taper: the last layer gets avg/beta, the first 2*avg - avg/beta, linear between. Default 1.25
  // (layer 0 at 1.2x the average, the last at 0.8x; kvpress and the paper use 20): on models/tiny
  // the gentler the taper the better at every level -- at 50 % of the bytes out-of-domain KL 0.048
  // (beta 1.25), 0.054 (1.5), 0.058 (2); at 6.25 % passkey 0.94 / 0.91 / 0.81 and kvlist 0.94 / 0.80
  // / 0.60; steeper still (5, 20) lost retrieval at 25 % (docs/results.md, tables J and E).
  double pyramidkv_beta = 1.25;

  // --- options shared by every H2O-core method (h2o, squeeze, pyramidkv) ---
  // "query_aware" (default): the settings measured to keep a real model working (docs/results.md)
  // -- a recent window of 32 (at most half the room above the sinks of each layer's budget), a
  // SnapKV-style prefill (the prompt scored by the attention of its last 16 queries, max-pooled
  // over 15 positions), attention normalised by how many queries could see each token, and the
  // other layers' prefill attention counted in each layer's choice (evict_cross_layer).
  // "original": the documented H2O-adapted core (key proxy, no window, no decay), which freezes
  // on the first tokens of the prompt (seed-behaviour.md section 2). The fields below override
  // the profile one by one; their "auto" values (-1, "auto") take the profile's.
  std::string evict_profile = "query_aware";
  int evict_recent_window = -1;  // newest tokens protected from eviction (original: 0)
  // Score: "key_proxy" (documented: the incoming key is the query), "attention" (the real
  // attention each token receives, summed over the query heads of its KV group, reported by the
  // engine), "attention_normalized" (that sum divided by how many queries could see the token).
  // Or a registered score (src/kvslim/cache/row_scores.cc): "value_norm_attention" (normalised
  // attention times the L1 norm of the row's value, VATP).
  // An attention scoring falls back to the key proxy when an update is never observed.
  std::string evict_scoring = "auto";
  int evict_obs_window = -1;  // prefill: score by the last N queries only (auto 16; 0 = all; original: 0)
  int evict_pool_kernel = -1;  // prefill: max-pool the scores over N positions (odd; auto 15; original: 1)
  double evict_decay = -1;     // per observed query, older scores x decay, in (0, 1] (auto: 1)
  // Cross-layer importance (kvslim's): in a prefill each layer also scores its rows by the
  // attention the other layers' prompt queries paid to the same positions, times this weight, so a
  // token one layer's queries need is kept by the layers that will read it while decoding
  // (docs/methods.md). Needs the layers of one model (KVCacheBuilder::for_model) and an attention
  // scoring. 0 = off; auto: 0.1 (query_aware), 0 (original).
  double evict_cross_layer = -1;

  // --- streaming (StreamingLLM: sinks + recent window) ---
  int streaming_budget = 512;
  int streaming_n_sink = 4;

  // --- zipcache (ZipCache-adapted) ---
  // Defaults re-chosen with the later question in view (issue 27, docs/results.md "zipcache's split
  // re-chosen"): the seed's 4 / 2 bits with half the rows salient and groups of 128 rows (the seed:
  // 20 % salient, groups of 32; eval variant zipcache_4_2_h20).
  int zipcache_hi_bits = 4;
  int zipcache_lo_bits = 2;
  double zipcache_hi_fraction = 0.5;
  int zipcache_group_size = 128;
  bool zipcache_quantize_values = true;  // values at uniform hi_bits (as the original code does)
  // Values at their own width (1..8), or -1 (default): zipcache_hi_bits (issue 27).
  int zipcache_value_bits = -1;
  // Tokens that wait in fp16 before being compressed together (0 = compress every call alone,
  // the documented behaviour). Must be a multiple of group_size.
  int zipcache_staging = 128;
  // Saliency: "key_norm" (documented proxy) or "attention_normalized" (the paper's signal, from
  // the observation hook).
  std::string zipcache_saliency = "key_norm";

  // --- kivi (uniform asymmetric group quantization, both K and V, KIVI-style) ---
  // Keys and values at kivi_bits each (1..8), or, at -1 (the default), keys at 4 bits and values at
  // 2. On models/tiny the keys need the bits, the values do not (issue 27, kvlist after the context:
  // 4-bit keys / 2-bit values in groups of 128 rows 0.93 at 20.5 % of the full cache's bytes, 2 / 2
  // bits in groups of 32 0.42 at 19 %, 3-bit keys / 2-bit values 0.85, 2-bit keys / 3-bit values
  // 0.20; docs/results.md). kivi_key_bits / kivi_value_bits (1..8, or -1) set one width alone. Both
  // the kivi method and storage=kivi read them; a CUDA device takes 2, 4 or 8 bits for each.
  int kivi_bits = -1;
  int kivi_key_bits = -1;
  int kivi_value_bits = -1;
  int kivi_group_size = 128;  // rows per quantization group (the eval's kivi2 / kivi4 pin 32)
  int kivi_staging = 128;  // fp16 residual tokens waiting to be quantized a block at a time
  // The widths kivi quantizes keys and values at: kivi_key_bits / kivi_value_bits, else kivi_bits,
  // else the default 4 / 2.
  int kivi_keys_at() const { return kivi_key_bits != -1 ? kivi_key_bits : kivi_bits != -1 ? kivi_bits : 4; }
  int kivi_values_at() const { return kivi_value_bits != -1 ? kivi_value_bits : kivi_bits != -1 ? kivi_bits : 2; }

  // --- how the rows are held (the storage under an eviction policy) ---
  // A cache is a policy over a storage. The eviction methods (full, streaming, h2o, pyramidkv,
  // squeeze) hold their kept rows in "fp16" slots (default), or compressed: "kivi" (uniform
  // group quantization at kivi_keys_at() / kivi_values_at() bits, groups of kivi_group_size rows; a prompt's survivors are
  // compressed at once, decode rows once kivi_staging of them wait) or "zipcache" (salient rows' keys at zipcache_hi_bits, the rest at zipcache_lo_bits,
  // values at hi_bits; zipcache_saliency "attention_normalized" = the policy's own row scores). So
  // method=squeeze storage=zipcache is both seeds in one cache. Methods kivi and zipcache are
  // storages already (their storage stays fp16); a CUDA device holds fp16, kivi or zipcache (its
  // saliency by key norm) under h2o, pyramidkv, squeeze and streaming.
  std::string storage = "fp16";

  // --- where the cache lives ---
  // "cpu" (default), or "cuda" / "cuda:N": storage and attention kernels in that GPU's memory
  // (kvslim/cuda.h: methods full, streaming, h2o, squeeze, pyramidkv and kivi; blocks and queries must then be device tensors).
  std::string device = "cpu";
  // -1 for "cpu", N for "cuda:N" ("cuda" = 0); -2 when the text is neither.
  int device_index() const;

  // Throws ConfigError naming the field and its allowed range.
  void validate() const;
  // Sets a field from text ("squeeze_strength", "0.5"); throws ConfigError on an unknown field or
  // a value that does not parse. Used by the CLI's --set key=value.
  void set(std::string_view field, std::string_view value);
  // Every settable field with its current value as text, in declaration order.
  std::vector<std::pair<std::string, std::string>> fields() const;
};

}  // namespace kvslim
