// kvslim/cuda.h when kvslim is built without CUDA (KVSLIM_CUDA off, or no nvcc found).
#include "kvslim/cuda.h"

#include "kvslim/errors.h"

namespace kvslim::cuda {

bool built() { return false; }
int device_count() { return 0; }
std::string device_description(int) { return "kvslim was built without CUDA"; }
std::unique_ptr<KVCache> make_cache(const KVCacheConfig& config, int, std::shared_ptr<SqueezeCoordinator>, int) {
  throw ConfigError("KVCacheConfig.device = \"" + config.device +
                    "\": this kvslim was built without CUDA (configure with -DKVSLIM_CUDA=ON where nvcc is installed)");
}

struct StepGraph::Impl {};
StepGraph::StepGraph(const std::vector<KVCache*>&) {
  throw ConfigError("StepGraph: this kvslim was built without CUDA (configure with -DKVSLIM_CUDA=ON where nvcc is installed)");
}
StepGraph::~StepGraph() = default;
void StepGraph::begin_capture(int, int) {}
void StepGraph::end_capture(void*) {}
void StepGraph::replay(void*) {}
std::size_t StepGraph::steps() const { return 0; }
std::size_t StepGraph::nodes() const { return 0; }

}  // namespace kvslim::cuda
