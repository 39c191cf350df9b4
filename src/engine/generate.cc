#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>

namespace kvslim::engine {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double GenerateResult::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_ids.size()) / prefill_seconds : 0.0;
}

double GenerateResult::decode_tokens_per_second() const {
  const std::size_t steps = generated_ids.empty() ? 0 : generated_ids.size() - 1;
  return decode_seconds > 0 ? static_cast<double>(steps) / decode_seconds : 0.0;
}

GenerateResult generate_tokens(Transformer& transformer, std::span<const int> prompt_ids,
                               const GenerateOptions& options, const std::function<void(int)>& on_token) {
  if (prompt_ids.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  if (options.max_tokens < 0) {
    throw std::invalid_argument("max_tokens must be >= 0, got " + std::to_string(options.max_tokens));
  }
  // Every position the run may use, before any work: the last sampled token is never fed back.
  const std::int64_t span = static_cast<std::int64_t>(prompt_ids.size()) - 1 + std::max(options.max_tokens - 1, 0);
  const std::int64_t last = transformer.next_position() > std::numeric_limits<std::int64_t>::max() - span
                                ? std::numeric_limits<std::int64_t>::max()
                                : transformer.next_position() + span;
  check_context_length(transformer.model().config(), transformer.options(), last,
                       "prompt of " + std::to_string(prompt_ids.size()) + " tokens + max_tokens " +
                           std::to_string(options.max_tokens));
  Sampler sampler(options.sampler, transformer.model().config().vocab_size);
  GenerateResult result;
  result.prompt_ids.assign(prompt_ids.begin(), prompt_ids.end());
  result.generated_ids.reserve(options.max_tokens);

  auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits = transformer.prefill(prompt_ids);
  result.prefill_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < options.max_tokens; ++i) {
    if (i > 0) logits = transformer.decode(result.generated_ids.back());
    const int next = sampler.sample(logits);
    result.generated_ids.push_back(next);
    if (on_token) on_token(next);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), next) != options.stop_ids.end()) {
      result.stopped_at_eos = true;
      break;
    }
  }
  result.decode_seconds = seconds_since(t0);
  return result;
}

GenerateResult generate_text(Transformer& transformer, const Tokenizer& tokenizer, std::string_view prompt,
                             const GenerateOptions& options, const std::function<void(std::string_view)>& on_text) {
  const std::vector<int> ids = tokenizer.encode(prompt, /*add_special_tokens=*/true);
  StreamDecoder stream(tokenizer);
  std::string text;
  auto on_token = [&](int id) {
    // The stop token ends the text; it is not part of it.
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), id) != options.stop_ids.end()) return;
    // A padded embedding row beyond the tokenizer's vocabulary (Qwen2 pads to a multiple of 128)
    // has no text; HF's decode drops such ids too. The id stays in generated_ids.
    if (id >= tokenizer.vocab_size()) return;
    const std::string piece = stream.push(id);
    text += piece;
    if (on_text && !piece.empty()) on_text(piece);
  };
  GenerateResult result = generate_tokens(transformer, ids, options, on_token);
  const std::string rest = stream.flush();
  text += rest;
  if (on_text && !rest.empty()) on_text(rest);
  result.text = std::move(text);
  return result;
}

}  // namespace kvslim::engine
