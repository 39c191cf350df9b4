#include "engine/finite_check.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "engine/model.h"

namespace kvslim::engine {
namespace {

// Non-finite == all exponent bits set, for each storage type.
template <class Bits>
bool any_exponent_saturated(const void* data, std::size_t n, Bits exponent_mask) {
  const Bits* p = static_cast<const Bits*>(data);
  Bits bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad |= static_cast<Bits>((p[i] & exponent_mask) == exponent_mask);
  return bad != 0;
}

bool has_non_finite(const void* data, WeightType type, std::size_t n) {
  switch (type) {
    case WeightType::f32: return any_exponent_saturated<std::uint32_t>(data, n, 0x7f800000u);
    case WeightType::f16: return any_exponent_saturated<std::uint16_t>(data, n, 0x7c00u);
    case WeightType::bf16: return any_exponent_saturated<std::uint16_t>(data, n, 0x7f80u);
    default: break;
  }
  // Block formats: decoded a chunk of whole blocks at a time (a NaN/Inf can only come from a scale).
  const std::size_t chunk = weight_block_elements(type) * 64;
  std::vector<float> tmp(chunk);
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < n; i += chunk) {
    const std::size_t m = std::min(chunk, n - i);
    convert_weights(p + weight_bytes(type, i), type, tmp.data(), m);
    if (!all_finite(tmp.data(), m)) return true;
  }
  return false;
}

bool has_non_finite(const Matrix& m) {
  if (weight_interleave_rows(m.type) == 1) return has_non_finite(m.data, m.type, m.rows * m.cols);
  std::vector<float> tmp(16 * m.cols);  // an interleaved type: 16 rows (one group) at a time
  for (std::size_t r = 0; r < m.rows; r += 16) {
    const std::size_t nr = std::min<std::size_t>(16, m.rows - r);
    convert_rows(m, r, nr, tmp.data());
    if (!all_finite(tmp.data(), nr * m.cols)) return true;
  }
  return false;
}
bool has_non_finite(const std::vector<float>& v) { return !all_finite(v.data(), v.size()); }

// The weights one stage reads, in the order the forward pass reads them, with their HF names.
struct Named {
  std::string name;
  bool bad;
};

std::vector<Named> stage_weights(const Model& model, int layer) {
  const ModelWeights& w = model.weights();
  const int n_layers = static_cast<int>(w.layers.size());
  if (layer < 0) return {{"model.embed_tokens.weight", has_non_finite(w.embed)}};
  if (layer >= n_layers) {
    const bool tied = w.lm_head.data == w.embed.data;
    return {{"model.norm.weight", has_non_finite(w.final_norm)},
            {tied ? "model.embed_tokens.weight (tied lm_head)" : "lm_head.weight", has_non_finite(w.lm_head)}};
  }
  const LayerWeights& L = w.layers[static_cast<std::size_t>(layer)];
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  return {{p + "input_layernorm.weight", has_non_finite(L.attn_norm)},
          {p + "self_attn.q_proj.weight", has_non_finite(L.wq)},
          {p + "self_attn.k_proj.weight", has_non_finite(L.wk)},
          {p + "self_attn.v_proj.weight", has_non_finite(L.wv)},
          {p + "self_attn.q_proj.bias", has_non_finite(L.bq)},
          {p + "self_attn.k_proj.bias", has_non_finite(L.bk)},
          {p + "self_attn.v_proj.bias", has_non_finite(L.bv)},
          {p + "self_attn.o_proj.weight", has_non_finite(L.wo)},
          {p + "post_attention_layernorm.weight", has_non_finite(L.mlp_norm)},
          {p + "mlp.gate_proj.weight", has_non_finite(L.w_gate)},
          {p + "mlp.up_proj.weight", has_non_finite(L.w_up)},
          {p + "mlp.down_proj.weight", has_non_finite(L.w_down)}};
}

}  // namespace

bool all_finite(const float* x, std::size_t n) {
  return !any_exponent_saturated<std::uint32_t>(x, n, 0x7f800000u);
}

void throw_non_finite(const Model& model, int layer) {
  const int n_layers = static_cast<int>(model.weights().layers.size());
  const std::string stage = layer < 0           ? std::string("the token embeddings")
                            : layer >= n_layers ? std::string("the logits (final norm + lm_head)")
                                                : "layer " + std::to_string(layer);
  for (const Named& t : stage_weights(model, layer)) {
    if (t.bad) {
      throw NonFiniteError("forward: non-finite values (NaN/Inf) first appear in " + stage + ": tensor '" + t.name +
                           "' holds NaN/Inf");
    }
  }
  throw NonFiniteError("forward: non-finite values (NaN/Inf) first appear in " + stage +
                       "; its weights are finite, so the activations overflowed there");
}

}  // namespace kvslim::engine
