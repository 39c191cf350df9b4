// The one way kvslim's kernels are launched: straight onto the caller's stream, or -- while a
// StepGraph captures or re-arms a decode step (step_graph.h) -- as a node of that step's CUDA graph.
// A launch site whose kernel runs in some steps only (kivi's flush of a full window, a segment with
// no rows yet) passes enabled = false in the others: on a stream nothing happens; in a graph the
// node stays, switched off, so that every step's graph has the same nodes in the same order.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvslim::cuda {
namespace launch_detail {

// func(args...) on `stream` with its argument addresses; dependent: programmatic dependent launch
// (sm_90: may start while the previous kernel of the stream runs; see attend_shared.cuh).
void launch(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
            void** args, bool enabled);

}  // namespace launch_detail

// kernel<<<grid, block, smem, stream>>>(args...) when `enabled`, through launch_detail::launch.
template <typename... Params, typename... Args>
void launch_kernel(bool enabled, bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                   cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "launch_kernel: one argument per kernel parameter");
  // The arguments converted to the kernel's parameter types, alive until the launch (or the graph
  // node's update) has copied them.
  std::tuple<std::decay_t<Params>...> values(std::forward<Args>(args)...);
  void* addresses[sizeof...(Params) > 0 ? sizeof...(Params) : 1] = {};
  std::apply([&](auto&... v) {
    std::size_t i = 0;
    ((addresses[i++] = static_cast<void*>(&v)), ...);
  }, values);
  launch_detail::launch(reinterpret_cast<const void*>(kernel), grid, block, smem, stream, dependent, addresses,
                        enabled);
}

}  // namespace kvslim::cuda
