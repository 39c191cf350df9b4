// bench attend --device cuda in a kvslim built without CUDA.
#include <stdexcept>

#include "cli/bench_attend_cuda.h"

namespace kvslim::cli {

int run_cuda_attend_bench(const CudaAttendOptions&) {
  throw std::runtime_error("--device cuda: this kvslim was built without CUDA (configure with -DKVSLIM_CUDA=ON)");
}

}  // namespace kvslim::cli
