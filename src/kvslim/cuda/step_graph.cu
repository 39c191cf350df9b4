#include "cuda/step_graph.h"

#include <string>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/device_buffer.h"
#include "cuda/device_cache.h"
#include "cuda/kernel_launch.h"
#include "kvslim/cuda.h"
#include "kvslim/errors.h"

namespace kvslim::cuda {
namespace {

thread_local LaunchScope* g_active_scope = nullptr;

dim3 at_least_one(dim3 d) { return dim3(d.x ? d.x : 1, d.y ? d.y : 1, d.z ? d.z : 1); }

void launch_on_stream(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
                      void** args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = dependent ? attr : nullptr;
  config.numAttrs = dependent ? 1 : 0;
  KVSLIM_CUDA_CHECK(cudaLaunchKernelExC(&config, func, args));
}

[[noreturn]] void graph_error(const std::string& what) { throw InputError("cuda StepGraph: " + what); }

// A thread's side stream on one device, with the fork and join events of launch_side_by_side. Kept
// for the thread's life and never destroyed: destruction at thread exit may come after the CUDA
// runtime has unloaded.
struct SideStream {
  int device = -1;
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
thread_local std::vector<SideStream> g_side_streams;

SideStream* side_stream_of(int device) {
  for (SideStream& s : g_side_streams) {
    if (s.device == device) return &s;
  }
  return nullptr;
}

}  // namespace

void prepare_side_stream() {
  int device = 0;
  KVSLIM_CUDA_CHECK(cudaGetDevice(&device));
  if (side_stream_of(device) != nullptr) return;
  SideStream s;
  s.device = device;
  KVSLIM_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  KVSLIM_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  KVSLIM_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  g_side_streams.push_back(s);
}

void launch_side_by_side(cudaStream_t stream, const std::function<void(cudaStream_t)>& first,
                         const std::function<void(cudaStream_t)>& second) {
  const LaunchScope* scope = LaunchScope::active();
  SideStream* side = nullptr;
  if (scope != nullptr && scope->capturing()) {
    int device = 0;
    KVSLIM_CUDA_CHECK(cudaGetDevice(&device));
    side = side_stream_of(device);
  }
  if (side == nullptr) {
    first(stream);
    second(stream);
    return;
  }
  // Captured: the side stream joins the capture at the fork, so `second`'s node depends on what
  // preceded the fork only; the join makes the origin stream's next node wait for both.
  KVSLIM_CUDA_CHECK(cudaEventRecord(side->fork, stream));
  KVSLIM_CUDA_CHECK(cudaStreamWaitEvent(side->stream, side->fork, 0));
  // Joined however the launches end: a launch that throws while capturing must not leave the side
  // stream outside the join (the capture would then end in cudaErrorStreamCaptureUnjoined, which
  // hides the launch's own error).
  struct JoinOnThrow {
    SideStream* side;
    cudaStream_t stream;
    bool armed = true;
    ~JoinOnThrow() {
      if (armed && cudaEventRecord(side->join, side->stream) == cudaSuccess) cudaStreamWaitEvent(stream, side->join, 0);
    }
  } guard{side, stream};
  first(stream);
  second(side->stream);
  guard.armed = false;
  KVSLIM_CUDA_CHECK(cudaEventRecord(side->join, side->stream));
  KVSLIM_CUDA_CHECK(cudaStreamWaitEvent(stream, side->join, 0));
}

namespace launch_detail {

void launch(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
            void** args, bool enabled) {
  if (LaunchScope* scope = LaunchScope::active()) {
    scope->route(func, grid, block, smem, stream, dependent, args, enabled);
    return;
  }
  if (enabled) launch_on_stream(func, grid, block, smem, stream, dependent, args);
}

}  // namespace launch_detail

// ---------------------------------------------------------------------------------------------
// LaunchSlots / LaunchScope

void LaunchSlots::capture(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool,
                          void** args, bool enabled) {
  // A switched-off site still becomes a node (with a valid shape; its arguments are set before it
  // first runs), so that every step's graph holds the same nodes. No programmatic (early) launch
  // in a graph: a node switched off in some steps would stand between a kernel and the one it
  // waits for, and a replay has no launch latency to hide.
  launch_on_stream(func, at_least_one(grid), block, smem, stream, false, args);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  std::size_t n = 0;
#if CUDART_VERSION >= 13000
  KVSLIM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n));
#else
  KVSLIM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, &n));
#endif
  if (status != cudaStreamCaptureStatusActive) graph_error("a kernel was launched on a stream that is not capturing");
  if (n != 1) graph_error("the captured kernel has " + std::to_string(n) + " predecessors in the capture (one stream only)");
  cudaGraphNodeType type{};
  KVSLIM_CUDA_CHECK(cudaGraphNodeGetType(deps[0], &type));
  if (type != cudaGraphNodeTypeKernel) graph_error("the capture's last node is not the kernel just launched");
  slots_.push_back(Slot{deps[0], func, enabled});
}

void LaunchSlots::update(std::size_t index, cudaGraphExec_t exec, const void* func, dim3 grid, dim3 block,
                         std::size_t smem, void** args, bool enabled) {
  if (index >= slots_.size()) {
    graph_error("this step launches more kernels than the captured one (" + std::to_string(slots_.size()) +
                "); capture again");
  }
  Slot& s = slots_[index];
  if (s.func != func) graph_error("kernel " + std::to_string(index) + " of the step is not the captured one; capture again");
  if (!enabled) {
    if (s.enabled) KVSLIM_CUDA_CHECK(cudaGraphNodeSetEnabled(exec, s.node, 0));
    s.enabled = false;
    return;
  }
  cudaKernelNodeParams p{};
  p.func = const_cast<void*>(func);
  p.gridDim = grid;
  p.blockDim = block;
  p.sharedMemBytes = static_cast<unsigned>(smem);
  p.kernelParams = args;
  KVSLIM_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, s.node, &p));
  if (!s.enabled) KVSLIM_CUDA_CHECK(cudaGraphNodeSetEnabled(exec, s.node, 1));
  s.enabled = true;
}

void LaunchSlots::apply_initial_state(cudaGraphExec_t exec) const {
  for (const Slot& s : slots_) {
    if (!s.enabled) KVSLIM_CUDA_CHECK(cudaGraphNodeSetEnabled(exec, s.node, 0));
  }
}

LaunchScope::LaunchScope(LaunchSlots& slots, LaunchSlots::Mode mode, cudaGraphExec_t exec)
    : slots_(slots), mode_(mode), exec_(exec), previous_(g_active_scope) {
  g_active_scope = this;
}

LaunchScope::~LaunchScope() { g_active_scope = previous_; }

LaunchScope* LaunchScope::active() { return g_active_scope; }

void LaunchScope::route(const void* func, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, bool dependent,
                        void** args, bool enabled) {
  if (mode_ == LaunchSlots::Mode::capture) {
    slots_.capture(func, grid, block, smem, stream, dependent, args, enabled);
  } else {
    slots_.update(cursor_, exec_, func, grid, block, smem, args, enabled);
  }
  ++cursor_;
}

// ---------------------------------------------------------------------------------------------
// StepGraph (kvslim/cuda.h)

struct StepGraph::Impl {
  std::vector<DeviceCache*> caches;
  int device = 0;
  cudaGraphExec_t exec = nullptr;
  bool capturing = false;
  bool captured_step_pending = false;  // the captured step has not run yet (capture runs nothing)
  std::size_t steps = 0;
};

StepGraph::StepGraph(const std::vector<KVCache*>& caches) : impl_(std::make_unique<Impl>()) {
  if (caches.empty()) graph_error("no caches");
  for (std::size_t i = 0; i < caches.size(); ++i) {
    auto* c = dynamic_cast<DeviceCache*>(caches[i]);
    if (c == nullptr) {
      graph_error("cache " + std::to_string(i) + (caches[i] ? " (" + std::string(caches[i]->method()) + ")" : "") +
                  " is not a CUDA device cache (KVCacheConfig.device = \"cuda\")");
    }
    if (!c->graph_replayable()) {
      graph_error("cache " + std::to_string(i) + " (" + std::string(c->method()) +
                  ") has no replayable decode step");
    }
    if (i > 0 && c->device() != impl_->caches[0]->device()) graph_error("the caches are on different GPUs");
    impl_->caches.push_back(c);
  }
  impl_->device = impl_->caches[0]->device();
}

StepGraph::~StepGraph() {
  DeviceGuard guard(impl_->device);
  for (DeviceCache* c : impl_->caches) c->graph_end();
  if (impl_->exec) cudaGraphExecDestroy(impl_->exec);
}

void StepGraph::begin_capture(int query_heads, int query_tokens) {
  if (impl_->exec || impl_->capturing) graph_error("begin_capture: this StepGraph has already captured a step");
  if (query_heads <= 0 || query_tokens <= 0 || query_tokens > kInlinePositions) {
    graph_error("begin_capture: query_heads must be >= 1 and query_tokens in 1.." + std::to_string(kInlinePositions) +
                " (got " + std::to_string(query_heads) + ", " + std::to_string(query_tokens) + ")");
  }
  DeviceGuard guard(impl_->device);
  prepare_side_stream();
  try {
    for (DeviceCache* c : impl_->caches) c->graph_begin(query_heads, query_tokens);
  } catch (...) {
    // A cache refused: the ones before it leave their capture too (eager steps go on, a later
    // begin_capture may try again).
    for (DeviceCache* c : impl_->caches) c->graph_end();
    throw;
  }
  impl_->capturing = true;
}

void StepGraph::end_capture(void* graph) {
  if (!impl_->capturing) graph_error("end_capture without begin_capture");
  if (graph == nullptr) graph_error("end_capture: no graph");
  DeviceGuard guard(impl_->device);
  impl_->capturing = false;
  for (DeviceCache* c : impl_->caches) c->graph_captured();
  KVSLIM_CUDA_CHECK(cudaGraphInstantiate(&impl_->exec, static_cast<cudaGraph_t>(graph), 0));
  for (DeviceCache* c : impl_->caches) c->graph_slots().apply_initial_state(impl_->exec);
  impl_->captured_step_pending = true;
}

void StepGraph::replay(void* stream) {
  if (impl_->exec == nullptr) graph_error("replay before a step was captured");
  DeviceGuard guard(impl_->device);
  const auto s = static_cast<cudaStream_t>(stream);
  if (impl_->captured_step_pending) {
    impl_->captured_step_pending = false;  // its nodes already hold its arguments
  } else {
    for (DeviceCache* c : impl_->caches) c->graph_arm(impl_->exec, s);
  }
  KVSLIM_CUDA_CHECK(cudaGraphLaunch(impl_->exec, s));
  for (DeviceCache* c : impl_->caches) c->graph_launched(s);
  ++impl_->steps;
}

bool StepGraph::next_step_replays(void* stream) {
  if (impl_->capturing) graph_error("next_step_replays while a step is being captured");
  if (impl_->captured_step_pending) return true;  // the captured step itself, whose nodes hold its arguments
  DeviceGuard guard(impl_->device);
  const auto s = static_cast<cudaStream_t>(stream);
  bool replays = true;
  for (DeviceCache* c : impl_->caches) replays = c->graph_prepare_next(s, impl_->exec != nullptr) && replays;
  return replays;
}

std::size_t StepGraph::steps() const { return impl_->steps; }

std::size_t StepGraph::nodes() const {
  std::size_t n = 0;
  for (DeviceCache* c : impl_->caches) n += c->graph_slots().size();
  return n;
}

}  // namespace kvslim::cuda
