// The Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM) and its forward pass through
// kvslim caches. Three separate things, as in llama2.c / yalm:
//   Model        config + weights (kept as stored in the mmap'ed safetensors, bf16/f16/f32)
//   CacheSet     the KV state, one kvslim cache per layer (owned by the caller)
//   Transformer  the activations (every scratch buffer, allocated once) and forward()
// Compute is fp32. Prefill runs the projections as sgemm over fp32 weight tiles; decode reads the
// stored weights directly with the SIMD gemv.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/attention.h"
#include "engine/model_config.h"
#include "engine/ops.h"
#include "engine/safetensors.h"
#include "kvslim/factory.h"

namespace kvslim::engine {

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> mlp_norm;   // [hidden]
  Matrix wq;                     // [heads * head_dim, hidden]
  Matrix wk, wv;                 // [kv_heads * head_dim, hidden]
  Matrix wo;                     // [hidden, heads * head_dim]
  Matrix w_gate, w_up;           // [intermediate, hidden]
  Matrix w_down;                 // [hidden, intermediate]
  std::vector<float> bq;         // [heads * head_dim]; empty without attention bias
  std::vector<float> bk, bv;     // [kv_heads * head_dim]; empty without attention bias
};

struct ModelWeights {
  Matrix embed;                    // [vocab, hidden]
  std::vector<float> final_norm;   // [hidden]
  Matrix lm_head;                  // [vocab, hidden]; the embedding itself when tied
  std::vector<LayerWeights> layers;
};

class Model {
 public:
  // config.json (+ generation_config.json) and the safetensors weights of `model_dir`, or a
  // .gguf file (engine/gguf_model.h). Every tensor's shape is checked against the config;
  // throws ModelFileError naming file and tensor.
  static Model load(const std::filesystem::path& model_dir);
  static Model from(ModelConfig config, WeightStore store);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  const WeightStore& store() const { return *store_; }
  // What kvslim needs to build one cache per layer.
  ModelSpec cache_spec() const;
  // Elements of every tensor in the files (a tied lm_head counted once).
  std::uint64_t parameter_count() const;
  // Bytes of weights one decode step reads (every layer matrix + the lm_head).
  std::uint64_t decode_weight_bytes() const;

 private:
  ModelConfig config_;
  std::unique_ptr<WeightStore> store_;
  ModelWeights weights_;
};

struct ForwardOptions {
  PrefillAttention prefill_attention = PrefillAttention::cache_view;
  int threads = 2;                   // gemv / decode attention threads (OpenBLAS has its own)
  std::size_t prefill_chunk = 0;     // tokens per prefill forward call; 0 = the whole prompt
  std::size_t max_chunk = 256;       // scratch sized for this many tokens up front (grows if needed)
  std::size_t max_context = 2048;    // attention scratch sized for this many cached rows up front
  // Positions >= config max_position_embeddings are refused (ContextLengthError): the model was
  // not trained there and its output degrades without a sign. true runs them anyway.
  bool allow_past_max_positions = false;
};

// A position at or past the model's max_position_embeddings without allow_past_max_positions.
class ContextLengthError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};
// Throws ContextLengthError unless positions up to `last_position` fit the model or are allowed;
// `what` says what needs them ("prompt of 3000 tokens").
void check_context_length(const ModelConfig& config, const ForwardOptions& options, std::int64_t last_position,
                          const std::string& what);

class Transformer {
 public:
  // The model and caches must outlive the Transformer. caches.size() == number of layers.
  Transformer(const Model& model, CacheSet& caches, ForwardOptions options = {});

  // Runs `tokens` at absolute `positions` (same length, increasing; empty: continue after the last
  // position this Transformer ran) through every layer, updating the caches. Returns the logits of
  // every token, [S, vocab], when `all_logits`, else of the last token, [vocab]. `prefill` selects
  // prefill behaviour (prefill_attention mode, hidden-state observation). The span is valid until
  // the next call.
  std::span<const float> forward(std::span<const int> tokens, std::span<const std::int64_t> positions = {},
                                 bool all_logits = false, bool prefill = false);
  // One decode step: the token at the next position. Returns logits [vocab].
  std::span<const float> decode(int token) { return forward(std::span<const int>(&token, 1)); }

  // The prompt in chunks of options.prefill_chunk tokens (from the next position). When
  // `on_logits` is set it gets every chunk's logits [chunk, vocab] and the index of the chunk's
  // first token in `tokens`. Returns the last token's logits [vocab].
  using LogitsCallback = std::function<void(std::size_t first, std::span<const float> logits)>;
  std::span<const float> prefill(std::span<const int> tokens, const LogitsCallback& on_logits = {});

  // The position the next token gets.
  std::int64_t next_position() const { return next_position_; }
  // Forgets the sequence: resets the caches and the position counter.
  void reset();
  const ForwardOptions& options() const { return options_; }
  const Model& model() const { return model_; }

 private:
  void ensure_tokens(std::size_t s);
  void attention_block(std::size_t layer, std::size_t s, std::span<const std::int64_t> positions, bool prefill);

  const Model& model_;
  CacheSet& caches_;
  ForwardOptions options_;
  ThreadPool pool_;
  ParallelFor parallel_;  // pool_ as KVCache::attend's task runner
  RopeTable rope_;
  Attention attention_;
  std::int64_t next_position_ = 0;
  std::size_t capacity_ = 0;  // tokens the per-token buffers hold

  // Activations, [S, ...] for a call of S tokens (capacity_ rows allocated).
  std::vector<float> x_;         // [S, hidden] residual stream
  std::vector<float> xb_;        // [S, hidden] normed input of a block / block output
  std::vector<float> x_before_;  // [S, hidden] residual before attention (hidden observation only)
  std::vector<float> q_;         // [S, heads * head_dim]
  std::vector<float> k_, v_;     // [S, kv_heads * head_dim]
  std::vector<float> k_block_, v_block_;  // [kv_heads, S, head_dim] for update_and_fetch
  std::vector<float> attn_;      // [S, heads * head_dim]
  std::vector<float> gate_, up_; // [S, intermediate]
  std::vector<float> cos_, sin_; // [S, head_dim / 2]
  std::vector<float> logits_;    // [S or 1, vocab]
  std::vector<float> observation_, observation_cat_;  // [kv_heads, S, rows] (attention hook only)
  std::vector<std::int64_t> positions_;  // [S] when the caller passes none
  std::vector<float> tile_;      // [kTileRows, max(hidden, intermediate, heads * head_dim)] weight tile for sgemm
};

}  // namespace kvslim::engine
