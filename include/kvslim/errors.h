// kvslim error types. Every error names what is wrong (field, tensor, file) and what was expected.
#pragma once
#include <stdexcept>
#include <string>

namespace kvslim {

// A configuration field outside its allowed range. Thrown by KVCacheConfig::validate(), and so by
// the factory and builder before anything is built.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A tensor handed to a cache has the wrong shape, dtype or content (NaN/Inf keys, empty block...).
class InputError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace kvslim
