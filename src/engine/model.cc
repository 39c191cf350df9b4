#include "engine/model.h"

#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/finite_check.h"
#include "engine/gguf_model.h"
#include "kvslim/block.h"

namespace kvslim::engine {

namespace {

// Weight rows converted per sgemm tile in prefill: 256 rows x up to ~16K columns = 16 MiB.
constexpr std::size_t kTileRows = 256;
// Prefill queries (tokens x query heads per KV head) from which attention runs as sgemm over the
// materialised rows instead of the cache's own kernel.
constexpr std::size_t kBlasMinQueries = 64;

Matrix matrix_of(const WeightStore& store, const std::string& name, std::int64_t rows, std::int64_t cols) {
  const TensorInfo& t = store.get(name, {rows, cols});
  return Matrix{t.type, t.data, static_cast<std::size_t>(rows), static_cast<std::size_t>(cols)};
}

std::vector<float> vector_of(const WeightStore& store, const std::string& name, std::int64_t n) {
  const TensorInfo& t = store.get(name, {n});
  std::vector<float> out(static_cast<std::size_t>(n));
  convert_weights(t.data, t.type, out.data(), out.size());
  return out;
}

void check_config(const ModelConfig& c) {
  auto positive = [](int v, const char* field) {
    if (v <= 0) throw ModelFileError(std::string("config.json: ") + field + " must be > 0, got " + std::to_string(v));
  };
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_layers, "num_hidden_layers");
  positive(c.num_heads, "num_attention_heads");
  positive(c.num_kv_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  positive(c.vocab_size, "vocab_size");
  if (c.head_dim % 2 != 0) {
    throw ModelFileError("config.json: head_dim " + std::to_string(c.head_dim) + " must be even (RoPE rotates pairs)");
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    throw ModelFileError("config.json: num_attention_heads " + std::to_string(c.num_heads) +
                         " is not a multiple of num_key_value_heads " + std::to_string(c.num_kv_heads));
  }
  if (!(c.rms_norm_eps > 0)) throw ModelFileError("config.json: rms_norm_eps must be > 0");
  if (!(c.rope_theta > 0)) throw ModelFileError("config.json: rope_theta must be > 0");
}

// Grow-only scratch, geometric so a context that grows by one row per step reallocates rarely.
template <class T>
void grow(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(std::max(n, v.size() + v.size() / 2));
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Model

Model Model::load(const std::filesystem::path& model_dir) {
  if (is_gguf_path(model_dir)) {
    GgufModel g = read_gguf_model(model_dir);
    return from(std::move(g.config), std::move(g.store));
  }
  // Any other path is named for what it is, before a file inside it is looked for (a
  // .safetensors file given as the model used to read "Not a directory": issue 26).
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(model_dir, ec);
  if (!std::filesystem::exists(st)) {
    throw ModelFileError(model_dir.string() + ": no such model directory or .gguf file");
  }
  if (!std::filesystem::is_directory(st)) {
    const bool safetensors = model_dir.extension() == ".safetensors";
    throw ModelFileError(model_dir.string() + ": is a file but not a GGUF model; expected a model directory (config.json, " +
                         "*.safetensors, tokenizer.json) or a .gguf file" +
                         (safetensors ? "; pass its directory " + model_dir.parent_path().string() : std::string()));
  }
  ModelConfig config = ModelConfig::load(model_dir);
  return from(std::move(config), WeightStore::open(model_dir));
}

Model Model::from(ModelConfig config, WeightStore store) {
  check_config(config);
  Model m;
  m.config_ = std::move(config);
  m.store_ = std::make_unique<WeightStore>(std::move(store));
  const ModelConfig& c = m.config_;
  const WeightStore& s = *m.store_;
  const std::int64_t hidden = c.hidden_size, inter = c.intermediate_size, vocab = c.vocab_size;
  const std::int64_t q_dim = static_cast<std::int64_t>(c.num_heads) * c.head_dim;
  const std::int64_t kv_dim = static_cast<std::int64_t>(c.num_kv_heads) * c.head_dim;

  ModelWeights& w = m.weights_;
  w.embed = matrix_of(s, "model.embed_tokens.weight", vocab, hidden);
  w.final_norm = vector_of(s, "model.norm.weight", hidden);
  // A tied model may still ship lm_head.weight (a copy); an untied one must.
  w.lm_head = c.tie_word_embeddings && !s.has("lm_head.weight") ? w.embed
                                                                : matrix_of(s, "lm_head.weight", vocab, hidden);
  // The config is checked against the tensors before anything is allocated per layer: the last
  // layer must exist, and layers are appended only once their tensors are found, so a config
  // claiming millions of layers costs nothing before it is refused.
  const std::string last_layer = "model.layers." + std::to_string(c.num_layers - 1) + ".input_layernorm.weight";
  if (!s.has(last_layer)) {
    throw ModelFileError("config.json: num_hidden_layers is " + std::to_string(c.num_layers) +
                         " but the weights have no tensor '" + last_layer + "'");
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& L = w.layers.emplace_back();
    L.attn_norm = vector_of(s, p + "input_layernorm.weight", hidden);
    L.mlp_norm = vector_of(s, p + "post_attention_layernorm.weight", hidden);
    L.wq = matrix_of(s, p + "self_attn.q_proj.weight", q_dim, hidden);
    L.wk = matrix_of(s, p + "self_attn.k_proj.weight", kv_dim, hidden);
    L.wv = matrix_of(s, p + "self_attn.v_proj.weight", kv_dim, hidden);
    L.wo = matrix_of(s, p + "self_attn.o_proj.weight", hidden, q_dim);
    L.w_gate = matrix_of(s, p + "mlp.gate_proj.weight", inter, hidden);
    L.w_up = matrix_of(s, p + "mlp.up_proj.weight", inter, hidden);
    L.w_down = matrix_of(s, p + "mlp.down_proj.weight", hidden, inter);
    // Qwen2 has q/k/v biases without saying so in config.json: take them when present, require
    // them when the config announces them.
    if (c.attention_bias || s.has(p + "self_attn.q_proj.bias")) {
      L.bq = vector_of(s, p + "self_attn.q_proj.bias", q_dim);
      L.bk = vector_of(s, p + "self_attn.k_proj.bias", kv_dim);
      L.bv = vector_of(s, p + "self_attn.v_proj.bias", kv_dim);
    }
  }
  return m;
}

ModelSpec Model::cache_spec() const {
  return ModelSpec::uniform(config_.num_layers, config_.num_kv_heads, config_.head_dim);
}

std::uint64_t Model::parameter_count() const {
  std::uint64_t total = 0;
  for (const std::string& name : store_->names()) {
    const TensorInfo* t = store_->find(name);
    std::uint64_t n = 1;
    for (std::int64_t d : t->shape) n *= static_cast<std::uint64_t>(d);
    total += n;
  }
  return total;
}

std::uint64_t Model::decode_weight_bytes() const {
  std::uint64_t total = weights_.lm_head.nbytes();
  for (const LayerWeights& L : weights_.layers) {
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) total += m->nbytes();
  }
  return total;
}

// ------------------------------------------------------------------------------------------------
// Transformer

void check_context_length(const ModelConfig& config, const ForwardOptions& options, std::int64_t last_position,
                          const std::string& what) {
  if (options.allow_past_max_positions || last_position < config.max_position_embeddings) return;
  throw ContextLengthError(what + " reaches position " + std::to_string(last_position) +
                           ", past the model's max_position_embeddings " +
                           std::to_string(config.max_position_embeddings) +
                           " (config.json); the model was not trained there. Shorten the input, or allow it "
                           "explicitly (ForwardOptions::allow_past_max_positions, CLI --allow-long-context)");
}

Transformer::Transformer(const Model& model, CacheSet& caches, ForwardOptions options)
    : model_(model),
      caches_(caches),
      options_(options),
      pool_(options.threads),
      parallel_([this](std::size_t n, const std::function<void(std::size_t)>& task) {
        auto each = [&task](int i) { task(static_cast<std::size_t>(i)); };
        pool_.for_each(static_cast<int>(n), each);
      }),
      rope_(model.config()),
      attention_(model.config().num_heads, model.config().num_kv_heads, model.config().head_dim,
                 std::max<std::size_t>(options.max_chunk, 1), std::max<std::size_t>(options.max_context, 1)) {
  const ModelConfig& c = model.config();
  if (options.threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(options.threads));
  // The engine's own pool splits every product (ops.h matmul, the prefill attention tasks), so
  // OpenBLAS runs single-threaded: its workers would otherwise spin beside the pool's threads.
  openblas_set_num_threads(1);
  if (caches.size() != static_cast<std::size_t>(c.num_layers)) {
    throw std::invalid_argument("cache set has " + std::to_string(caches.size()) + " layers, the model has " +
                                std::to_string(c.num_layers));
  }
  for (std::size_t l = 0; l < caches.size(); ++l) {
    if (caches[l] == nullptr) throw std::invalid_argument("cache set has no cache for layer " + std::to_string(l));
  }
  // The tile holds kTileRows rows of the widest matrix: o_proj's rows are heads x head_dim long,
  // which exceeds hidden_size in real models (Qwen3, Gemma), down_proj's are intermediate_size.
  const std::size_t q_dim = static_cast<std::size_t>(c.num_heads) * c.head_dim;
  tile_.resize(kTileRows * std::max({static_cast<std::size_t>(c.hidden_size),
                                     static_cast<std::size_t>(c.intermediate_size), q_dim}));
  ensure_tokens(std::max<std::size_t>(options.max_chunk, 1));
}

void Transformer::ensure_tokens(std::size_t s) {
  if (s <= capacity_) return;
  const ModelConfig& c = model_.config();
  const std::size_t hidden = c.hidden_size, q_dim = static_cast<std::size_t>(c.num_heads) * c.head_dim,
                    kv_dim = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim,
                    inter = c.intermediate_size, half = c.head_dim / 2;
  for (auto* v : {&x_, &xb_}) grow(*v, s * hidden);
  grow(q_, s * q_dim);
  grow(attn_, s * q_dim);
  for (auto* v : {&k_, &v_, &k_block_, &v_block_}) grow(*v, s * kv_dim);
  grow(gate_, s * inter);
  grow(up_, s * inter);
  grow(cos_, s * half);
  grow(sin_, s * half);
  grow(positions_, s);
  capacity_ = s;
}

void Transformer::reset() {
  caches_.reset();
  next_position_ = 0;
}

std::span<const float> Transformer::prefill(std::span<const int> tokens, const LogitsCallback& on_logits) {
  if (tokens.empty()) throw std::invalid_argument("prefill: empty prompt");
  // The whole prompt up front, so a chunked prefill does not run half of it first.
  const std::int64_t room = std::numeric_limits<std::int64_t>::max() - next_position_;
  check_context_length(model_.config(), options_,
                       static_cast<std::uint64_t>(room) < tokens.size()
                           ? std::numeric_limits<std::int64_t>::max()
                           : next_position_ + static_cast<std::int64_t>(tokens.size()) - 1,
                       "prompt of " + std::to_string(tokens.size()) + " tokens");
  const std::size_t chunk = options_.prefill_chunk == 0 ? tokens.size() : options_.prefill_chunk;
  std::span<const float> last;
  for (std::size_t first = 0; first < tokens.size(); first += chunk) {
    const std::size_t n = std::min(chunk, tokens.size() - first);
    last = forward(tokens.subspan(first, n), {}, static_cast<bool>(on_logits), /*prefill=*/true);
    if (on_logits) on_logits(first, last);
  }
  const std::size_t vocab = model_.config().vocab_size;
  return on_logits ? last.subspan(last.size() - vocab) : last;
}

std::span<const float> Transformer::forward(std::span<const int> tokens, std::span<const std::int64_t> positions,
                                            bool all_logits, bool prefill) {
  const ModelConfig& c = model_.config();
  const ModelWeights& w = model_.weights();
  const std::size_t s = tokens.size(), hidden = c.hidden_size, vocab = c.vocab_size, half = c.head_dim / 2;
  if (s == 0) throw std::invalid_argument("forward: no tokens");
  if (!positions.empty() && positions.size() != s) {
    throw std::invalid_argument("forward: " + std::to_string(positions.size()) + " positions for " +
                                std::to_string(s) + " tokens");
  }
  // Positions never wrap: the last one must leave room for a next one.
  const std::int64_t room = std::numeric_limits<std::int64_t>::max() - next_position_;
  if ((positions.empty() && static_cast<std::uint64_t>(room) < s) ||
      (!positions.empty() && positions[s - 1] == std::numeric_limits<std::int64_t>::max())) {
    throw std::invalid_argument("forward: positions would pass INT64_MAX (next position " +
                                std::to_string(next_position_) + ", " + std::to_string(s) + " tokens)");
  }
  ensure_tokens(s);
  if (positions.empty()) {
    for (std::size_t i = 0; i < s; ++i) positions_[i] = next_position_ + static_cast<std::int64_t>(i);
    positions = std::span<const std::int64_t>(positions_.data(), s);
  }
  for (std::size_t i = 0; i < s; ++i) {
    if (positions[i] < 0 || (i > 0 && positions[i] <= positions[i - 1])) {
      throw std::invalid_argument("forward: positions must be non-negative and increasing");
    }
  }
  check_context_length(c, options_, positions[s - 1], "forward: " + std::to_string(s) + " token(s)");

  // Embedding rows, RoPE angles of every token (shared by all layers and heads).
  for (std::size_t i = 0; i < s; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      throw std::invalid_argument("forward: token id " + std::to_string(tokens[i]) + " outside the vocabulary [0, " +
                                  std::to_string(c.vocab_size) + ")");
    }
    convert_rows(w.embed, static_cast<std::size_t>(tokens[i]), 1, x_.data() + i * hidden);
    rope_.angles(positions[i], cos_.data() + i * half, sin_.data() + i * half);
  }
  // NaN/Inf checks (embedding, each layer's K/V and output, logits): each costs one pass over
  // values that took thousands of multiply-adds each to produce, and names where they appeared.
  if (!all_finite(x_.data(), s * hidden)) throw_non_finite(model_, -1);

  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    KVCache& cache = *caches_[l];
    const bool observe_hidden = prefill && cache.needs().hidden_states;
    if (observe_hidden) {
      grow(x_before_, s * hidden);
      std::copy_n(x_.data(), s * hidden, x_before_.data());
    }
    attention_block(l, s, positions, prefill);
    if (observe_hidden) {
      cache.observe_hidden(HiddenObservation{x_before_.data(), x_.data(), 1, s, hidden});
    }
    // MLP: x += down(silu(gate(xn)) * up(xn))
    for (std::size_t i = 0; i < s; ++i) {
      rmsnorm(xb_.data() + i * hidden, x_.data() + i * hidden, L.mlp_norm.data(), hidden,
              static_cast<float>(c.rms_norm_eps));
    }
    if (s == 1) {  // decode: one activation quantization and one pool hand-off for both
      const Matrix* ws[2] = {&L.w_gate, &L.w_up};
      float* ys[2] = {gate_.data(), up_.data()};
      gemv_multi(ws, ys, 2, xb_.data(), &pool_);
    } else {
      matmul(L.w_gate, xb_.data(), s, gate_.data(), tile_.data(), kTileRows, &pool_);
      matmul(L.w_up, xb_.data(), s, up_.data(), tile_.data(), kTileRows, &pool_);
    }
    swiglu(gate_.data(), up_.data(), s * c.intermediate_size);
    matmul(L.w_down, gate_.data(), s, xb_.data(), tile_.data(), kTileRows, &pool_);
    for (std::size_t i = 0; i < s * hidden; ++i) x_[i] += xb_[i];
    if (!all_finite(x_.data(), s * hidden)) throw_non_finite(model_, static_cast<int>(l));
  }
  next_position_ = positions[s - 1] + 1;

  // Final norm and lm_head: every token's logits, or the last one's only.
  const std::size_t first = all_logits ? 0 : s - 1, n_out = s - first;
  for (std::size_t i = first; i < s; ++i) {
    rmsnorm(xb_.data() + i * hidden, x_.data() + i * hidden, w.final_norm.data(), hidden,
            static_cast<float>(c.rms_norm_eps));
  }
  grow(logits_, n_out * vocab);
  matmul(w.lm_head, xb_.data() + first * hidden, n_out, logits_.data(), tile_.data(), kTileRows, &pool_);
  if (!all_finite(logits_.data(), n_out * vocab)) throw_non_finite(model_, c.num_layers);
  return std::span<const float>(logits_.data(), n_out * vocab);
}

// x += o_proj(attention(rope(q), cache(rope(k), v))) for the S tokens of this call.
void Transformer::attention_block(std::size_t layer, std::size_t s, std::span<const std::int64_t> positions,
                                  bool prefill) {
  const ModelConfig& c = model_.config();
  const LayerWeights& L = model_.weights().layers[layer];
  KVCache& cache = *caches_[layer];
  const std::size_t hidden = c.hidden_size, d = c.head_dim, half = d / 2;
  const std::size_t heads = c.num_heads, kv_heads = c.num_kv_heads;
  const std::size_t q_dim = heads * d, kv_dim = kv_heads * d;

  for (std::size_t i = 0; i < s; ++i) {
    rmsnorm(xb_.data() + i * hidden, x_.data() + i * hidden, L.attn_norm.data(), hidden,
            static_cast<float>(c.rms_norm_eps));
  }
  if (s == 1) {  // decode: one activation quantization and one pool hand-off for q, k and v
    const Matrix* ws[3] = {&L.wq, &L.wk, &L.wv};
    float* ys[3] = {q_.data(), k_.data(), v_.data()};
    gemv_multi(ws, ys, 3, xb_.data(), &pool_);
  } else {
    matmul(L.wq, xb_.data(), s, q_.data(), tile_.data(), kTileRows, &pool_);  // [S, H*D]
    matmul(L.wk, xb_.data(), s, k_.data(), tile_.data(), kTileRows, &pool_);  // [S, Hkv*D]
    matmul(L.wv, xb_.data(), s, v_.data(), tile_.data(), kTileRows, &pool_);  // [S, Hkv*D]
  }
  if (!L.bq.empty()) {
    for (std::size_t i = 0; i < s; ++i) {
      for (std::size_t j = 0; j < q_dim; ++j) q_[i * q_dim + j] += L.bq[j];
      for (std::size_t j = 0; j < kv_dim; ++j) {
        k_[i * kv_dim + j] += L.bk[j];
        v_[i * kv_dim + j] += L.bv[j];
      }
    }
  }
  // RoPE at each token's true position; K/V regrouped to the cache's [H_kv, S, D].
  for (std::size_t i = 0; i < s; ++i) {
    const float* cs = cos_.data() + i * half;
    const float* sn = sin_.data() + i * half;
    for (std::size_t h = 0; h < heads; ++h) rope_rotate(q_.data() + i * q_dim + h * d, cs, sn, d);
    for (std::size_t h = 0; h < kv_heads; ++h) {
      float* k = k_.data() + i * kv_dim + h * d;
      rope_rotate(k, cs, sn, d);
      std::copy_n(k, d, k_block_.data() + (h * s + i) * d);
      std::copy_n(v_.data() + i * kv_dim + h * d, d, v_block_.data() + (h * s + i) * d);
    }
  }
  // Before the cache sees them: its own NaN check cannot name the layer.
  if (!all_finite(k_block_.data(), s * kv_dim) || !all_finite(v_block_.data(), s * kv_dim)) {
    throw_non_finite(model_, static_cast<int>(layer));
  }
  const KVBlock keys = make_block(k_block_.data(), 1, kv_heads, s, d);
  const KVBlock values = make_block(v_block_.data(), 1, kv_heads, s, d);
  const ObservationNeeds needs = cache.needs();
  const bool observe = needs.attention;
  // Only the queries the cache reads are observed (its observation window): the first `skip`
  // queries attend without probabilities, the last `observed` with them.
  const std::size_t observed =
      observe && needs.attention_queries > 0 && s > needs.attention_queries ? needs.attention_queries : s;
  const std::size_t skip = s - observed;
  const std::span<const std::int64_t> observed_positions = positions.subspan(skip);

  // Prefill attention has one path: sgemm over the rows as fp16 (Attention::attend), measured
  // 1.2-1.4x faster than the cache's own kernel at 512 tokens and 1.6-1.8x at 1536 on models/tiny
  // for full, h2o, kivi4 and zipcache (bench engine, docs/architecture.md). What differs is only the
  // view it reads: the cache's rows after it absorbed the chunk (cache_view), or the previous
  // view plus the whole chunk, absorbed after (full_prompt, the documented order). Fewer queries
  // than kBlasMinQueries (decode, a short follow-up) go through the cache's own kernel over its
  // storage, the decode path.
  const bool full_prompt = prefill && options_.prefill_attention == PrefillAttention::full_prompt;
  if (full_prompt || (prefill && s * (heads / kv_heads) >= kBlasMinQueries)) {
    CacheView view;
    if (full_prompt) {
      view = attention_.concat(cache.view(), k_block_.data(), v_block_.data(), positions);
    } else {
      cache.append(keys, values, positions);
      view = cache.materialize();  // the fp16 adapter of any storage
    }
    float* probs = nullptr;
    if (observe) {
      std::vector<float>& out = full_prompt ? observation_cat_ : observation_;
      grow(out, attention_.observation_size(observed, view.tokens));
      probs = out.data();
    }
    if (skip > 0) attention_.attend(view, q_.data(), positions.first(skip), attn_.data(), nullptr, &pool_);
    attention_.attend(view, q_.data() + skip * q_dim, observed_positions, attn_.data() + skip * q_dim, probs, &pool_);
    std::size_t rows = cache.rows();  // cache_view: the rows the view holds
    if (full_prompt) {
      const CacheView kept = cache.update_and_fetch(keys, values, positions);
      rows = kept.tokens;
      if (observe) {
        grow(observation_, attention_.observation_size(observed, rows));
        attention_.remap_observation(view, observation_cat_.data(), observed, kept, observation_.data());
      }
    }
    if (observe) {
      cache.observe_attention(AttentionObservation{observation_.data(), 1, kv_heads, observed, rows, rows, observed_positions});
    }
  } else {
    // The cache attends over its own storage (compressed caches read their codes) and observes its
    // own probabilities (in its row order): nothing here reads them.
    cache.append(keys, values, positions);
    const std::size_t rows = cache.rows();
    if (observe) grow(observation_, attention_.observation_size(observed, rows));
    float* probs = observe ? observation_.data() : nullptr;
    const bool threaded = rows * d * kv_heads * s >= (1u << 15);  // below this the pool costs more
    ParallelFor* parallel = threaded ? &parallel_ : nullptr;
    if (skip > 0) {
      cache.attend(QueryBlock{q_.data(), 1, skip, heads, d}, positions.first(skip), attn_.data(), nullptr, parallel);
    }
    cache.attend_and_observe(QueryBlock{q_.data() + skip * q_dim, 1, observed, heads, d}, observed_positions,
                             attn_.data() + skip * q_dim, probs, kv_heads, parallel);
  }
  matmul(L.wo, attn_.data(), s, xb_.data(), tile_.data(), kTileRows, &pool_);  // [S, hidden]
  for (std::size_t i = 0; i < s * hidden; ++i) x_[i] += xb_[i];
}

}  // namespace kvslim::engine
