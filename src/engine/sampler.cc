#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvslim::engine {

void SamplerConfig::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    throw std::invalid_argument("temperature must be a finite value >= 0, got " + std::to_string(temperature));
  }
  if (top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0 = no limit), got " + std::to_string(top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    throw std::invalid_argument("top_p must be in (0, 1], got " + std::to_string(top_p));
  }
}

std::uint64_t Rng::next() {
  std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float Rng::uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }

int argmax(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("argmax: no logits");
  return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(SamplerConfig config, int vocab_size) : config_(config), rng_(config.seed) {
  config_.validate();
  if (vocab_size <= 0) throw std::invalid_argument("sampler: vocab_size must be > 0");
  order_.resize(vocab_size);
  probs_.resize(vocab_size);
}

int Sampler::sample(std::span<const float> logits) {
  const std::size_t n = order_.size();
  if (logits.size() != n) {
    throw std::invalid_argument("sampler: " + std::to_string(logits.size()) + " logits, expected " +
                                std::to_string(n));
  }
  if (config_.temperature == 0.0f) return argmax(logits);

  // Candidates: the top_k most likely (all when top_k is 0 or >= vocab), most likely first.
  std::iota(order_.begin(), order_.end(), 0);
  const std::size_t k = config_.top_k == 0 ? n : std::min<std::size_t>(n, config_.top_k);
  auto more_likely = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (k < n) {
    std::nth_element(order_.begin(), order_.begin() + k, order_.end(), more_likely);
  }
  // Sorting is only needed for top-p; top-k alone samples from the unordered candidates.
  const bool nucleus = config_.top_p < 1.0f;
  if (nucleus) std::sort(order_.begin(), order_.begin() + k, more_likely);

  // Softmax over the candidates at the given temperature.
  float max_logit = -INFINITY;
  for (std::size_t i = 0; i < k; ++i) max_logit = std::max(max_logit, logits[order_[i]]);
  double sum = 0;
  for (std::size_t i = 0; i < k; ++i) {
    probs_[i] = std::exp((logits[order_[i]] - max_logit) / config_.temperature);
    sum += probs_[i];
  }
  std::size_t kept = k;
  if (nucleus) {
    // The smallest prefix whose mass reaches top_p (at least one token).
    double mass = 0;
    for (std::size_t i = 0; i < k; ++i) {
      mass += probs_[i] / sum;
      if (mass >= config_.top_p) {
        kept = i + 1;
        break;
      }
    }
    sum = 0;
    for (std::size_t i = 0; i < kept; ++i) sum += probs_[i];
  }
  const double target = static_cast<double>(rng_.uniform()) * sum;
  double acc = 0;
  for (std::size_t i = 0; i < kept; ++i) {
    acc += probs_[i];
    if (target < acc) return order_[i];
  }
  return order_[kept - 1];  // rounding left target at the very top
}

}  // namespace kvslim::engine
