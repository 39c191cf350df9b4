// Prompt -> prefill -> decode loop, with streaming text and timing. The token-level entry point
// needs no tokenizer (tests, evaluation); the text one encodes, streams and decodes.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"

namespace kvslim::engine {

struct GenerateOptions {
  int max_tokens = 128;            // new tokens at most (>= 0)
  SamplerConfig sampler;
  std::vector<int> stop_ids;       // stop after producing one of these (the model's EOS ids)
};

struct GenerateResult {
  std::vector<int> prompt_ids;
  std::vector<int> generated_ids;  // includes the stop token when one ended the run
  std::string text;                // decoded generation (text entry point only)
  bool stopped_at_eos = false;
  double prefill_seconds = 0, decode_seconds = 0;
  // Tokens per second; decode counts the forward steps (every generated token but the first,
  // which comes from the prefill logits).
  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;
};

// Runs `prompt_ids` from the Transformer's next position (call transformer.reset() first for a
// fresh sequence) and samples up to max_tokens tokens. `on_token` is called with every new id.
GenerateResult generate_tokens(Transformer& transformer, std::span<const int> prompt_ids,
                               const GenerateOptions& options,
                               const std::function<void(int)>& on_token = {});

// Encodes `prompt` (with the tokenizer's special tokens, e.g. BOS), generates, and streams the
// text through `on_text` in complete UTF-8 characters.
GenerateResult generate_text(Transformer& transformer, const Tokenizer& tokenizer, std::string_view prompt,
                             const GenerateOptions& options,
                             const std::function<void(std::string_view)>& on_text = {});

}  // namespace kvslim::engine
