// The registry's private half: each method's builder, beside its row (methods.cc).
#pragma once
#include <memory>
#include <optional>

#include "kvslim/cache.h"
#include "kvslim/methods.h"
#include "kvslim/squeeze.h"

namespace kvslim {

// What one layer's cache gets besides the config.
struct LayerContext {
  int layer_id = -1;
  std::optional<int> budget;  // per-layer budget (pyramidkv taper)
  std::shared_ptr<SqueezeCoordinator> coordinator;
};

using MethodBuilder = std::unique_ptr<KVCache> (*)(const KVCacheConfig&, const LayerContext&);

// The builder of a registered method (CPU); nullptr when the name is not registered.
MethodBuilder method_builder(std::string_view name);

}  // namespace kvslim
