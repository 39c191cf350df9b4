#include "engine/reconstruction_score.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvslim/factory.h"

namespace kvslim::engine {
namespace {

// One layer's cache during the scoring: plain fp16 rows (a `full` cache) that can go back to
// the context alone, and, while recording, the engine's attention of every query of a call.
class ReconstructionRecorder final : public KVCache {
 public:
  ReconstructionRecorder(std::size_t heads, std::size_t context, float weight)
      : inner_(KVCacheFactory::create(full_config())), heads_(heads), context_(context) {
    auto scores = std::make_shared<PriorScores>();
    scores->weight = weight;
    scores->heads = heads;
    scores->length = context;
    scores->values.assign(heads * context, 0.0f);
    scores_ = scores;
  }

  void append(const KVBlock& keys, const KVBlock& values, std::span<const std::int64_t> positions) override {
    inner_->append(keys, values, positions);
  }
  void attend(const QueryBlock& queries, std::span<const std::int64_t> query_positions, float* out, float* probs,
              const ParallelFor* parallel) const override {
    inner_->attend(queries, query_positions, out, probs, parallel);
  }
  std::size_t rows() const override { return inner_->rows(); }
  CacheView materialize() const override { return inner_->materialize(); }
  CacheStats stats() const override { return inner_->stats(); }
  void reset() override { inner_->reset(); }
  void reserve(std::size_t tokens) override { inner_->reserve(tokens); }
  // Every query of a call while recording (a chunk is a few hundred queries: [H_kv, S, rows] of
  // fp32 is a few MB at these sizes).
  ObservationNeeds needs() const override { return ObservationNeeds{recording_, false, 0}; }
  void observe_attention(const AttentionObservation& obs) override {
    if (!recording_) return;
    const CacheView v = inner_->materialize();
    if (obs.batch != 1 || obs.heads != heads_ || obs.tokens != v.tokens || obs.query_positions.size() != obs.queries) {
      throw std::logic_error("reconstruction scores: the observation does not match the recorder's rows");
    }
    for (std::size_t h = 0; h < heads_; ++h) {
      float* out = scores_->values.data() + h * context_;
      for (std::size_t q = 0; q < obs.queries; ++q) {
        if (obs.query_positions[q] < copy_start_) continue;  // the repeat prompt's own queries
        const float* p = obs.probs + (h * obs.queries + q) * obs.stride;
        for (std::size_t i = 0; i < v.tokens; ++i) {
          const std::int64_t pos = v.position(0, h, i);
          if (pos >= 0 && static_cast<std::size_t>(pos) < context_) {
            out[pos] = std::max(out[pos], p[i]);
          }
        }
      }
    }
  }
  std::string_view method() const override { return "reconstruction"; }

  // After the context's prefill: keep its rows, to go back to before every chunk.
  void snapshot() {
    const CacheView v = inner_->materialize();
    dim_ = v.head_dim;
    keys_.resize(heads_ * v.tokens * dim_);
    values_.resize(keys_.size());
    positions_.resize(v.tokens);
    for (std::size_t h = 0; h < heads_; ++h) {
      std::memcpy(keys_.data() + h * v.tokens * dim_, v.key_row(0, h, 0), v.tokens * dim_ * sizeof(std::uint16_t));
      std::memcpy(values_.data() + h * v.tokens * dim_, v.value_row(0, h, 0), v.tokens * dim_ * sizeof(std::uint16_t));
    }
    for (std::size_t i = 0; i < v.tokens; ++i) positions_[i] = v.position(0, 0, i);
    recording_ = true;
  }
  // The context's rows alone again (a chunk's rows removed); copy queries start at `copy_start`.
  void rewind(std::int64_t copy_start) {
    inner_->reset();
    const std::size_t n = positions_.size();
    inner_->append(make_block_fp16(keys_.data(), 1, heads_, n, dim_), make_block_fp16(values_.data(), 1, heads_, n, dim_),
                   positions_);
    copy_start_ = copy_start;
  }
  std::shared_ptr<const PriorScores> scores() const { return scores_; }

 private:
  static KVCacheConfig full_config() {
    KVCacheConfig c;
    c.method = "full";
    return c;
  }
  std::unique_ptr<KVCache> inner_;
  std::size_t heads_, context_, dim_ = 0;
  std::shared_ptr<PriorScores> scores_;
  std::vector<std::uint16_t> keys_, values_;  // fp16 [heads, context, dim]
  std::vector<std::int64_t> positions_;
  std::int64_t copy_start_ = 0;
  bool recording_ = false;
};

}  // namespace

std::vector<std::shared_ptr<const PriorScores>> reconstruction_scores(const Model& model, std::span<const int> context,
                                                                      const ReconstructionOptions& options) {
  if (context.empty()) throw std::invalid_argument("reconstruction scores: empty context");
  if (options.chunk == 0) throw std::invalid_argument("reconstruction scores: chunk must be >= 1");
  const ModelSpec spec = model.cache_spec();
  std::vector<std::unique_ptr<KVCache>> layers;
  std::vector<ReconstructionRecorder*> recorders;
  for (const LayerSpec& l : spec.layers) {
    if (!l.attention) {
      layers.emplace_back();
      recorders.push_back(nullptr);
      continue;
    }
    auto r = std::make_unique<ReconstructionRecorder>(static_cast<std::size_t>(l.kv_heads), context.size(), options.weight);
    recorders.push_back(r.get());
    layers.push_back(std::move(r));
  }
  CacheSet caches = CacheSet::of_layers(std::move(layers));
  const std::size_t longest = options.repeat_prompt.size() + std::min(options.chunk, context.size());
  ForwardOptions fo;
  fo.threads = options.threads;
  fo.max_chunk = std::max(context.size(), longest);
  fo.max_context = context.size() + longest;
  Transformer transformer(model, caches, fo);
  // Throws ContextLengthError before any work when the chunks would pass the model's positions.
  check_context_length(model.config(), fo, static_cast<std::int64_t>(context.size() + longest) - 1,
                       "reconstruction of a " + std::to_string(context.size()) + "-token context");
  transformer.prefill(context);
  for (auto* r : recorders) {
    if (r != nullptr) r->snapshot();
  }
  std::vector<int> tokens;
  std::vector<std::int64_t> positions;
  const auto start = static_cast<std::int64_t>(context.size());
  for (std::size_t first = 0; first < context.size(); first += options.chunk) {
    const std::size_t n = std::min(options.chunk, context.size() - first);
    tokens.assign(options.repeat_prompt.begin(), options.repeat_prompt.end());
    tokens.insert(tokens.end(), context.begin() + static_cast<std::ptrdiff_t>(first),
                  context.begin() + static_cast<std::ptrdiff_t>(first + n));
    positions.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) positions[i] = start + static_cast<std::int64_t>(i);
    const std::int64_t copy_start = start + static_cast<std::int64_t>(options.repeat_prompt.size());
    for (auto* r : recorders) {
      if (r != nullptr) r->rewind(copy_start);
    }
    transformer.forward(tokens, positions, /*all_logits=*/false, /*prefill=*/true);
  }
  std::vector<std::shared_ptr<const PriorScores>> out;
  for (auto* r : recorders) out.push_back(r != nullptr ? r->scores() : nullptr);
  return out;
}

}  // namespace kvslim::engine
