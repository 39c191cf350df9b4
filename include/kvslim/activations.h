// The library's run-time dispatched fp32 activations that an inference engine needs beside the
// cache (kvslim's reference engine uses them for its MLP and sampling): softmax and SwiGLU.
#pragma once
#include <cstddef>

namespace kvslim::kernels {

// x = softmax(x) in place (max-subtracted); -inf entries get 0. At least one entry is finite.
void softmax_inplace(float* x, std::size_t n);
// gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i] (SwiGLU).
void swiglu_inplace(float* gate, const float* up, std::size_t n);

}  // namespace kvslim::kernels
