// Next-token choice from logits: greedy, or temperature with optional top-k and top-p (nucleus)
// filtering, drawn from a seeded RNG so a run repeats exactly.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kvslim::engine {

struct SamplerConfig {
  float temperature = 0.0f;  // 0 = greedy (argmax); > 0 divides the logits before softmax
  int top_k = 0;             // keep the k most likely tokens (0 = no limit; k >= vocab keeps all)
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p, in (0, 1]
  std::uint64_t seed = 0;

  // Throws std::invalid_argument naming the field and its allowed range.
  void validate() const;
};

// splitmix64: tiny, fast, and every seed (0 included) gives a good stream.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  float uniform();  // [0, 1), 24 random bits

 private:
  std::uint64_t state_;
};

class Sampler {
 public:
  Sampler(SamplerConfig config, int vocab_size);  // validates; allocates all scratch here
  // The next token for logits [vocab_size]. Ties in greedy mode go to the lowest id.
  int sample(std::span<const float> logits);
  const SamplerConfig& config() const { return config_; }

 private:
  SamplerConfig config_;
  Rng rng_;
  std::vector<int> order_;     // [vocab] candidate ids
  std::vector<float> probs_;   // [vocab] their probabilities
};

// Index of the largest value (the first one on ties).
int argmax(std::span<const float> logits);

}  // namespace kvslim::engine
