// Text fidelity against the full cache (kvpress-like, query-agnostic): a context of C tokens is
// prefilled through the method's cache (the compression happens there), then T continuation
// tokens are teacher-forced one decode step at a time; every step's next-token distribution is
// compared with the full cache's on the same window.
#pragma once
#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "engine/model.h"

namespace kvslim::engine::eval {

struct TextWindow {
  std::vector<int> tokens;  // [context + continuation]: (bos) + context tokens, then the continuation
  std::size_t context = 0;  // tokens prefilled; the rest are teacher-forced
  std::size_t continuation() const { return tokens.size() - context; }
};

// `count` non-overlapping windows cut from `stream` in order, each starting with `bos` when given
// (then it takes one context slot). Throws std::invalid_argument naming what is missing when the
// stream is too short or a size is zero.
std::vector<TextWindow> make_windows(std::span<const int> stream, std::optional<int> bos, std::size_t context,
                                     std::size_t continuation, std::size_t count);

struct WindowRun {
  std::vector<float> log_probs;  // [T, vocab]: step t predicts tokens[context + t] (log-softmax)
  std::size_t resident_bytes = 0;  // the caches' resident bytes right after the prefill
  double kept_tokens = 0;          // tokens kept per attention layer right after the prefill (mean)
  double prefill_seconds = 0, decode_seconds = 0;
};

// Resets the transformer (and its caches), prefills the context and teacher-forces the
// continuation: step 0's distribution comes from the prefill, each later one from a decode step.
WindowRun run_window(Transformer& transformer, const CacheSet& caches, const TextWindow& window);

// Sums over steps (and windows) of a method run against the full-cache run of the same window.
struct FidelityTotals {
  double kl_sum = 0;        // sum of KL(full || method), nats
  double nll_sum = 0;       // sum of -log p_method(true next token)
  double ref_nll_sum = 0;   // the same for the full cache
  std::size_t steps = 0, top1_agree = 0;
  double resident_bytes_sum = 0, ref_resident_bytes_sum = 0;  // after each prefill
  double kept_tokens_sum = 0;  // mean kept tokens per layer after each prefill
  std::size_t windows = 0;

  double kl() const { return steps ? kl_sum / static_cast<double>(steps) : 0.0; }
  double top1() const { return steps ? static_cast<double>(top1_agree) / static_cast<double>(steps) : 0.0; }
  double ppl() const;
  double ref_ppl() const;
  double level() const { return ref_resident_bytes_sum > 0 ? resident_bytes_sum / ref_resident_bytes_sum : 0.0; }
  void add(const FidelityTotals& other);
};

// Compares one method run with the full-cache run of the same window. Throws
// std::invalid_argument when the runs do not have the same shape.
FidelityTotals compare_runs(const TextWindow& window, const WindowRun& reference, const WindowRun& method,
                            std::size_t vocab);

}  // namespace kvslim::engine::eval
