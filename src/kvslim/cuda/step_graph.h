// Decode steps replayed as one CUDA graph (kvslim/cuda.h: StepGraph): how a device cache's kernels
// become nodes of the caller's captured graph and are re-armed before every replay.
//
// The caller (kvslim.hf's graph decoder, through torch.cuda.CUDAGraph) captures one whole decode
// step -- the model's kernels and the caches' appends and attentions -- and the graph then stands
// for every later step. What changes from one step to the next is only the caches' state: row and
// group counts, the live staging window, the step's positions, the split counts, whether kivi
// flushes. The caches' host logic runs as in an eager step, but each launch it makes updates its
// node (cudaGraphExecKernelNodeSetParams) instead of reaching the stream: no kernel needs a device
// copy of the host state, and the host work per step is a few node updates instead of the
// framework's whole forward pass.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace kvslim::cuda {

// The kernel nodes one cache's step made, in launch order.
class LaunchSlots {
 public:
  enum class Mode { capture, update };
  struct Slot {
    cudaGraphNode_t node = nullptr;
    const void* func = nullptr;
    bool enabled = true;  // as the exec has it now
  };

  void clear() { slots_.clear(); }
  std::size_t size() const { return slots_.size(); }
  // After instantiation: the slots captured as disabled are switched off in `exec`.
  void apply_initial_state(cudaGraphExec_t exec) const;

  // Called by launch_detail::launch while a LaunchScope routes this thread's launches here.
  void capture(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
               void** args, bool enabled);
  void update(std::size_t index, cudaGraphExec_t exec, const void* func, dim3 grid, dim3 block, std::size_t smem,
              void** args, bool enabled);

 private:
  std::vector<Slot> slots_;
};

// Routes the calling thread's kernel launches to `slots` for its lifetime: appended as captured
// nodes (Mode::capture) or updating the next node in order in `exec` (Mode::update).
class LaunchScope {
 public:
  LaunchScope(LaunchSlots& slots, LaunchSlots::Mode mode, cudaGraphExec_t exec = nullptr);
  ~LaunchScope();
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;
  // Launches routed so far (update mode: every slot must be visited once per step).
  std::size_t visited() const { return cursor_; }

  static LaunchScope* active();
  bool capturing() const { return mode_ == LaunchSlots::Mode::capture; }
  void route(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
             void** args, bool enabled);

 private:
  LaunchSlots& slots_;
  LaunchSlots::Mode mode_;
  cudaGraphExec_t exec_;
  std::size_t cursor_ = 0;
  LaunchScope* previous_;
};

// Two launches of one step that do not wait for each other (a kivi attend's codes and its staging
// window write different partials): while a step is captured, `second` goes on a side stream forked
// from `stream` and joined back, so the replayed graph runs the two nodes side by side instead of
// one after the other. Otherwise both go on `stream` in order: eager launches already overlap by
// programmatic launch, and a re-armed step only updates the nodes (in the same order).
void launch_side_by_side(cudaStream_t stream, const std::function<void(cudaStream_t)>& first,
                         const std::function<void(cudaStream_t)>& second);
// The calling thread's side stream for the current device, made before a capture begins (a
// capture may refuse stream and event creation).
void prepare_side_stream();

}  // namespace kvslim::cuda
