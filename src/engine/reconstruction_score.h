// Reconstruction scores (KVzip's idea, issue 27): which tokens of a context will a later question
// need, before the question exists? KVzip's answer: the tokens the model itself attends to when it
// re-reads the context, copying it after a "repeat" prompt. Every token is reproduced once, so
// every fact gets a query that looks for it, and each layer and KV head shows which tokens it
// reads to reproduce it; that is what an unknown question will read too.
//
// Procedure: the context is prefilled into plain fp16 caches; then, chunk by chunk, the repeat
// prompt and the chunk's copy of the context are run after it (positions continuing after the
// context; each chunk alone, the previous chunk's rows removed first, so a chunk sees the context
// and itself only), and every context position gets, per layer and KV head, the largest attention
// (summed over the head's query group) any copy query gave it. Cost: a prefill of the context plus
// forward calls over the context again (each chunk attending over the whole context), about 2x a
// full-cache prefill on top of the compressing prefill itself; the eval prints it.
#pragma once
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "engine/model.h"
#include "kvslim/prior_scores.h"

namespace kvslim::engine {

struct ReconstructionOptions {
  std::vector<int> repeat_prompt;  // tokens before each chunk's copy; may be empty
  std::size_t chunk = 256;         // context tokens re-read per forward call (>= 1)
  int threads = 1;                 // engine threads
  float weight = 1.0f;             // PriorScores::weight of the result (against the window's attention)
};

// Per layer (null for a layer without attention): scores [kv_heads, context.size()], each the
// max attention a copy query gave that position. Throws std::invalid_argument for an empty
// context or chunk 0, ContextLengthError when context + repeat prompt + chunk pass the model's
// positions.
std::vector<std::shared_ptr<const PriorScores>> reconstruction_scores(const Model& model, std::span<const int> context,
                                                                      const ReconstructionOptions& options);

}  // namespace kvslim::engine
