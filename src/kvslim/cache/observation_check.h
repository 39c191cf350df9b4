// Observations are checked at the call, as append checks keys and values (issue 26): a NaN or
// infinite attention weight or hidden state used to break squeeze's memory bound or starve a
// layer silently, and surface as an error from another layer's call.
#pragma once
#include <cstddef>
#include <string>

#include "kvslim/cache.h"

namespace kvslim {

// Throw InputError naming `who` and the first non-finite value's place (or that probs are not host
// memory: every CPU cache calls this before it reads them). Observations without
// data (probs/before/after null) or with an inconsistent layout are left to the shape checks.
void check_observation_finite(const AttentionObservation& obs, const std::string& who);
void check_observation_finite(const HiddenObservation& obs, const std::string& who);
// The error both the host check and the device's (cuda/device_prompt_scoring.h) raise for a
// non-finite attention weight at [batch, head, query, token].
[[noreturn]] void throw_nonfinite_weight(const std::string& who, std::size_t batch, std::size_t head, std::size_t query,
                                         std::size_t token);

}  // namespace kvslim
