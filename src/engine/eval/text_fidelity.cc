#include "engine/eval/text_fidelity.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kvslim::engine::eval {
namespace {

// out[i] = x[i] - log(sum exp x), in double for the normaliser.
void log_softmax(std::span<const float> x, float* out) {
  const float mx = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (float v : x) sum += std::exp(static_cast<double>(v - mx));
  const double lse = static_cast<double>(mx) + std::log(sum);
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(static_cast<double>(x[i]) - lse);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<TextWindow> make_windows(std::span<const int> stream, std::optional<int> bos, std::size_t context,
                                     std::size_t continuation, std::size_t count) {
  if (context == 0 || continuation == 0 || count == 0) {
    throw std::invalid_argument("text windows: context, continuation and count must be >= 1 (got " +
                                std::to_string(context) + ", " + std::to_string(continuation) + ", " +
                                std::to_string(count) + ")");
  }
  const std::size_t lead = bos ? 1 : 0;
  if (context <= lead) throw std::invalid_argument("text windows: context must exceed the BOS token");
  const std::size_t per_window = context + continuation - lead;  // text tokens per window
  if (stream.size() < per_window * count) {
    throw std::invalid_argument("held-out text: " + std::to_string(stream.size()) + " tokens, but " +
                                std::to_string(count) + " windows of " + std::to_string(context) + " + " +
                                std::to_string(continuation) + " tokens need " + std::to_string(per_window * count));
  }
  std::vector<TextWindow> windows(count);
  for (std::size_t w = 0; w < count; ++w) {
    TextWindow& win = windows[w];
    win.context = context;
    win.tokens.reserve(context + continuation);
    if (bos) win.tokens.push_back(*bos);
    const auto first = stream.begin() + static_cast<std::ptrdiff_t>(w * per_window);
    win.tokens.insert(win.tokens.end(), first, first + static_cast<std::ptrdiff_t>(per_window));
  }
  return windows;
}

WindowRun run_window(Transformer& transformer, const CacheSet& caches, const TextWindow& window) {
  if (window.context == 0 || window.tokens.size() <= window.context) {
    throw std::invalid_argument("run_window: a window needs a context and at least one continuation token");
  }
  const std::size_t vocab = static_cast<std::size_t>(transformer.model().config().vocab_size);
  const std::size_t steps = window.continuation();
  WindowRun run;
  run.log_probs.resize(steps * vocab);
  transformer.reset();
  const std::span<const int> all(window.tokens);
  auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits = transformer.prefill(all.first(window.context));
  run.prefill_seconds = seconds_since(t0);
  auto measure = [&] {
    run.resident_bytes = caches.resident_bytes();
    run.kept_tokens = 0;
    std::size_t layers = 0;
    for (std::size_t l = 0; l < caches.size(); ++l) {
      if (caches[l] == nullptr) continue;
      run.kept_tokens += static_cast<double>(caches[l]->stats().tokens_kept);
      ++layers;
    }
    if (layers > 0) run.kept_tokens /= static_cast<double>(layers);
  };
  measure();
  // Squeeze layers adopt their schedule at their own next call (the threading rule in
  // kvslim/cache.h): right after the prefill only the last layer to report has, so a set with a
  // coordinator is measured again after the first decode step.
  const bool settles_later = caches.coordinator() != nullptr;
  log_softmax(logits, run.log_probs.data());
  t0 = std::chrono::steady_clock::now();
  for (std::size_t t = 1; t < steps; ++t) {
    logits = transformer.decode(window.tokens[window.context + t - 1]);
    log_softmax(logits, run.log_probs.data() + t * vocab);
    if (t == 1 && settles_later) measure();
  }
  run.decode_seconds = seconds_since(t0);
  return run;
}

double FidelityTotals::ppl() const { return steps ? std::exp(nll_sum / static_cast<double>(steps)) : 0.0; }
double FidelityTotals::ref_ppl() const { return steps ? std::exp(ref_nll_sum / static_cast<double>(steps)) : 0.0; }

void FidelityTotals::add(const FidelityTotals& o) {
  kl_sum += o.kl_sum;
  nll_sum += o.nll_sum;
  ref_nll_sum += o.ref_nll_sum;
  steps += o.steps;
  top1_agree += o.top1_agree;
  resident_bytes_sum += o.resident_bytes_sum;
  ref_resident_bytes_sum += o.ref_resident_bytes_sum;
  kept_tokens_sum += o.kept_tokens_sum;
  windows += o.windows;
}

FidelityTotals compare_runs(const TextWindow& window, const WindowRun& reference, const WindowRun& method,
                            std::size_t vocab) {
  const std::size_t steps = window.continuation();
  if (vocab == 0 || reference.log_probs.size() != steps * vocab || method.log_probs.size() != steps * vocab) {
    throw std::invalid_argument("compare_runs: expected " + std::to_string(steps) + " x " + std::to_string(vocab) +
                                " log-probabilities in both runs, got " + std::to_string(reference.log_probs.size()) +
                                " and " + std::to_string(method.log_probs.size()));
  }
  FidelityTotals t;
  t.steps = steps;
  t.windows = 1;
  t.resident_bytes_sum = static_cast<double>(method.resident_bytes);
  t.ref_resident_bytes_sum = static_cast<double>(reference.resident_bytes);
  t.kept_tokens_sum = method.kept_tokens;
  for (std::size_t s = 0; s < steps; ++s) {
    const float* p = reference.log_probs.data() + s * vocab;
    const float* q = method.log_probs.data() + s * vocab;
    double kl = 0;
    std::size_t best_p = 0, best_q = 0;
    for (std::size_t v = 0; v < vocab; ++v) {
      if (p[v] > -80.0f) kl += std::exp(static_cast<double>(p[v])) * (static_cast<double>(p[v]) - q[v]);
      if (p[v] > p[best_p]) best_p = v;
      if (q[v] > q[best_q]) best_q = v;
    }
    t.kl_sum += std::max(0.0, kl);  // rounding can leave -1e-9 for identical distributions
    t.top1_agree += best_p == best_q ? 1 : 0;
    const int next = window.tokens[window.context + s];
    if (next < 0 || static_cast<std::size_t>(next) >= vocab) {
      throw std::invalid_argument("compare_runs: token id " + std::to_string(next) + " outside the vocabulary");
    }
    t.nll_sum -= q[next];
    t.ref_nll_sum -= p[next];
  }
  return t;
}

}  // namespace kvslim::engine::eval
