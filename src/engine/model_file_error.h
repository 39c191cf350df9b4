// The error type of every model-file loader (safetensors, config.json, tokenizer.json).
#pragma once
#include <stdexcept>

namespace kvslim::engine {

// A model file is missing, malformed or unsupported. The message names the file and the
// tensor/field at fault, and what was expected.
class ModelFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvslim::engine
