#include "cache/observation_check.h"

#include <cstdint>
#include <cstring>

#include "kvslim/errors.h"

namespace kvslim {
namespace {

// Index of the first NaN/Inf of x[0..n) (an exponent of all ones), or n.
std::size_t first_nonfinite(const float* x, std::size_t n) {
  std::size_t i = 0;
  constexpr std::size_t kBlock = 256;
  for (; i < n; i += kBlock) {
    const std::size_t m = n - i < kBlock ? n - i : kBlock;
    std::uint32_t any = 0;
    for (std::size_t j = 0; j < m; ++j) {  // branch-free: vectorises
      std::uint32_t bits;
      std::memcpy(&bits, x + i + j, 4);
      any |= static_cast<std::uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    if (any != 0) {
      for (std::size_t j = 0; j < m; ++j) {
        std::uint32_t bits;
        std::memcpy(&bits, x + i + j, 4);
        if ((bits & 0x7f800000u) == 0x7f800000u) return i + j;
      }
    }
  }
  return n;
}

}  // namespace

void throw_nonfinite_weight(const std::string& who, std::size_t batch, std::size_t head, std::size_t query,
                            std::size_t token) {
  throw InputError(who + ": attention observation holds a NaN or infinite weight (batch " + std::to_string(batch) +
                   ", head " + std::to_string(head) + ", query " + std::to_string(query) + ", token " +
                   std::to_string(token) + "); nothing was changed");
}

void check_observation_finite(const AttentionObservation& obs, const std::string& who) {
  if (obs.space != MemorySpace::host) {
    throw InputError(who + ": the attention observation's probs are " + std::string(memory_space_name(obs.space)) +
                     " memory; this cache is on the CPU and reads host memory only");
  }
  if (obs.probs == nullptr || obs.tokens == 0 || obs.stride < obs.tokens) return;
  const std::size_t rows = obs.batch * obs.heads * obs.queries;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t at = first_nonfinite(obs.probs + r * obs.stride, obs.tokens);
    if (at < obs.tokens) {
      throw_nonfinite_weight(who, r / obs.queries / obs.heads, (r / obs.queries) % obs.heads, r % obs.queries, at);
    }
  }
}

void check_observation_finite(const HiddenObservation& obs, const std::string& who) {
  const std::size_t n = obs.batch * obs.tokens * obs.hidden;
  for (const auto& [data, name] : {std::pair<const float*, const char*>{obs.before, "before"}, {obs.after, "after"}}) {
    if (data == nullptr) continue;
    const std::size_t at = first_nonfinite(data, n);
    if (at < n) {
      throw InputError(who + ": hidden-state observation (" + name + " attention) holds a NaN or infinite value (token " +
                       std::to_string(at / obs.hidden) + ", dimension " + std::to_string(at % obs.hidden) + "); nothing was changed");
    }
  }
}

}  // namespace kvslim
