// A/B switches of the CUDA path read from the environment (KVSLIM_CUDA_*: the benchmarks' A/B of a
// kernel choice), host code only: unset or empty is the default, "1" on, "0" off, anything else an
// InputError naming the variable. Callers read a switch once per process (a function-local static).
#pragma once
#include <cstdlib>
#include <string>

#include "kvslim/errors.h"

namespace kvslim::cuda {

inline bool env_switch(const char* name, bool default_on) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_on;
  const std::string s(v);
  if (s == "1") return true;
  if (s == "0") return false;
  throw InputError(std::string(name) + ": '" + s + "' is not 0 or 1");
}

}  // namespace kvslim::cuda
