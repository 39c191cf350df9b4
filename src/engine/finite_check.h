// Non-finite values (NaN, Inf) in the forward pass: a cheap test the Transformer runs on the
// residual stream after every layer and on the logits, and the diagnosis that names where they
// first appeared when the test fails. Without it a model with NaN weights (or activations that
// overflow) samples token 0 forever without a word (issue 13, item 7).
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

namespace kvslim::engine {

class Model;

// The forward pass produced NaN or Inf. The message names the stage (the embedding of a token, a
// layer, the final norm + lm_head) and the first tensor there holding non-finite values, or says
// that its weights are finite (the activations overflowed). The caches and position hold a
// partly-run step afterwards: reset the Transformer before reusing it.
class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True when none of the n floats is NaN or +-Inf. An integer test on the exponent bits that the
// compiler vectorises: about n/8 cycles, against the n x (thousands) multiply-adds that produce
// the values, so running it on every layer's output costs well under 0.1% of a step.
bool all_finite(const float* x, std::size_t n);

// Where non-finite values first appeared; `layer` is the decoder layer whose output held them,
// -1 for the embedding rows, num_layers for the final norm + lm_head. Scans that stage's weight
// tensors (only on this error path) to name the first one holding NaN/Inf.
[[noreturn]] void throw_non_finite(const Model& model, int layer);

}  // namespace kvslim::engine
