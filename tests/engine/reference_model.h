// An independent double-precision forward pass written from HF's modeling_llama / modeling_qwen2
// (no cache, no SIMD, no BLAS): the yardstick of model_test and golden_model_test.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/model.h"
#include "kvslim/dtype.h"

namespace kvslim::engine::testing {

// Weights as doubles, straight from the store.
inline std::vector<double> tensor(const WeightStore& s, const std::string& name) {
  const TensorInfo* t = s.find(name);
  if (t == nullptr) return {};
  const std::size_t n = t->nbytes / weight_type_size(t->type);
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (t->type == WeightType::f32) {
      out[i] = static_cast<const float*>(t->data)[i];
    } else {
      const std::uint16_t h = static_cast<const std::uint16_t*>(t->data)[i];
      out[i] = t->type == WeightType::f16 ? fp16_to_f32(h) : bf16_to_f32(h);
    }
  }
  return out;
}

// y = W x (+ b): W [rows, cols].
inline std::vector<double> linear(const std::vector<double>& w, const std::vector<double>& x, std::size_t rows,
                           const std::vector<double>& bias = {}) {
  const std::size_t cols = x.size();
  std::vector<double> y(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    double acc = bias.empty() ? 0 : bias[r];
    for (std::size_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    y[r] = acc;
  }
  return y;
}

inline std::vector<double> rms(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1 / std::sqrt(ss / x.size() + eps);
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// HF LlamaForCausalLM / Qwen2ForCausalLM forward over the whole sequence, in double. With
// `fp16_kv`, K and V are rounded to fp16 after RoPE, as the kvslim cache stores them; without it
// this is the HF computation itself. Returns logits [S, vocab].
inline std::vector<double> reference_logits(const Model& model, const std::vector<int>& tokens, bool fp16_kv) {
  const ModelConfig& c = model.config();
  const WeightStore& s = model.store();
  const std::size_t S = tokens.size(), hid = c.hidden_size, H = c.num_heads, Hk = c.num_kv_heads, D = c.head_dim,
                    I = c.intermediate_size, V = c.vocab_size;
  const RopeTable rope(c);  // inv_freq checked separately against the formulas in ops_test
  const auto embed = tensor(s, "model.embed_tokens.weight");
  std::vector<std::vector<double>> x(S);
  for (std::size_t t = 0; t < S; ++t) x[t].assign(embed.begin() + tokens[t] * hid, embed.begin() + (tokens[t] + 1) * hid);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const auto wq = tensor(s, p + "self_attn.q_proj.weight"), wk = tensor(s, p + "self_attn.k_proj.weight"),
               wv = tensor(s, p + "self_attn.v_proj.weight"), wo = tensor(s, p + "self_attn.o_proj.weight"),
               bq = tensor(s, p + "self_attn.q_proj.bias"), bk = tensor(s, p + "self_attn.k_proj.bias"),
               bv = tensor(s, p + "self_attn.v_proj.bias"), n1 = tensor(s, p + "input_layernorm.weight"),
               n2 = tensor(s, p + "post_attention_layernorm.weight"), wg = tensor(s, p + "mlp.gate_proj.weight"),
               wu = tensor(s, p + "mlp.up_proj.weight"), wd = tensor(s, p + "mlp.down_proj.weight");
    std::vector<std::vector<double>> q(S), k(S), v(S);
    for (std::size_t t = 0; t < S; ++t) {
      const auto xn = rms(x[t], n1, c.rms_norm_eps);
      q[t] = linear(wq, xn, H * D, bq);
      k[t] = linear(wk, xn, Hk * D, bk);
      v[t] = linear(wv, xn, Hk * D, bv);
      auto rotate = [&](std::vector<double>& vec, std::size_t heads) {
        for (std::size_t h = 0; h < heads; ++h) {
          for (std::size_t i = 0; i < D / 2; ++i) {
            const double ang = static_cast<double>(static_cast<float>(t) * rope.inv_freq()[i]);
            const double a = vec[h * D + i], b = vec[h * D + i + D / 2];
            vec[h * D + i] = a * std::cos(ang) - b * std::sin(ang);
            vec[h * D + i + D / 2] = b * std::cos(ang) + a * std::sin(ang);
          }
        }
      };
      rotate(q[t], H);
      rotate(k[t], Hk);
      if (fp16_kv) for (double& e : k[t]) e = fp16_to_f32(f32_to_fp16(static_cast<float>(e)));
      if (fp16_kv) for (double& e : v[t]) e = fp16_to_f32(f32_to_fp16(static_cast<float>(e)));
    }
    for (std::size_t t = 0; t < S; ++t) {
      std::vector<double> attn(H * D, 0.0);
      for (std::size_t h = 0; h < H; ++h) {
        const std::size_t g = h / (H / Hk);
        std::vector<double> w(t + 1);
        double mx = -INFINITY, sum = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (std::size_t i = 0; i < D; ++i) dot += q[t][h * D + i] * k[j][g * D + i];
          w[j] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, w[j]);
        }
        for (double& e : w) sum += (e = std::exp(e - mx));
        for (std::size_t j = 0; j <= t; ++j) {
          for (std::size_t i = 0; i < D; ++i) attn[h * D + i] += w[j] / sum * v[j][g * D + i];
        }
      }
      const auto o = linear(wo, attn, hid);
      for (std::size_t i = 0; i < hid; ++i) x[t][i] += o[i];
      const auto xn = rms(x[t], n2, c.rms_norm_eps);
      auto gate = linear(wg, xn, I);
      const auto up = linear(wu, xn, I);
      for (std::size_t i = 0; i < I; ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      const auto down = linear(wd, gate, hid);
      for (std::size_t i = 0; i < hid; ++i) x[t][i] += down[i];
    }
  }
  const auto norm = tensor(s, "model.norm.weight");
  auto head = tensor(s, "lm_head.weight");
  if (head.empty()) head = embed;
  std::vector<double> logits;
  for (std::size_t t = 0; t < S; ++t) {
    const auto y = linear(head, rms(x[t], norm, c.rms_norm_eps), V);
    logits.insert(logits.end(), y.begin(), y.end());
  }
  return logits;
}

}  // namespace kvslim::engine::testing
