// kvslim on NVIDIA GPUs: caches whose storage and attention kernels live in GPU memory.
//
// A cache built with KVCacheConfig.device = "cuda" (or "cuda:N") takes device blocks (KVBlock and
// QueryBlock with space = MemorySpace::cuda, data in that GPU's memory, the caller's CUDA stream in
// `stream`) and does its work on that stream without waiting: append quantizes and packs in one
// kernel, attend reads the codes where they lie (split-K, every query head of a KV head in one pass,
// fp32 accumulation) and writes out / probs into device memory. Nothing goes through the host but
// the positions (a few bytes, passed with the launch). The KVCache contract holds with two
// differences, both stated where they apply:
//  - NaN/Inf or |x| > 65504 in a device block is found by the append kernel; the error is raised
//    by the first later call that finds the kernel done (append, attend, rows' stats, materialize),
//    since checking at once would stall the stream every step. The cache then refuses every call
//    until reset().
//  - materialize() and stats() wait for the stream.
// Methods on the device: "full" (fp16 slots, bf16 when the blocks are bf16), "kivi" (2/4/8-bit
// codes, keys and values per channel over groups of 32 tokens, the CPU's layout and rules, with its
// fp16 staging window), and "h2o" / "pyramidkv" (the CPU's eviction core over fp16 slots in GPU
// memory, scored by the attention the caller observes: attend with probs, then observe_attention
// with them, device memory accepted; a decode step's observation and eviction run on the device);
// head_dim 64 or 128.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kvslim/cache.h"
#include "kvslim/config.h"
#include "kvslim/squeeze.h"

namespace kvslim::cuda {

// Whether this kvslim was compiled with its CUDA kernels (CMake option KVSLIM_CUDA).
bool built();
// GPUs this process can use (0 when not built with CUDA or no driver/GPU is present).
int device_count();
// What the device and runtime are, for reports ("NVIDIA H200, sm_90, 132 SMs, CUDA 13.0").
std::string device_description(int device = 0);
// A cache for config.method on the GPU named by config.device. Throws ConfigError when kvslim was
// built without CUDA, the GPU does not exist, or the method has no device storage. layer_budget:
// the layer's own token budget where a per-layer schedule sets it (pyramidkv's taper; -1: the
// config's budget); coordinator / layer_id: squeeze's shared schedule and this layer's id in it
// (KVCacheBuilder passes them; without a coordinator squeeze keeps its configured budget).
std::unique_ptr<KVCache> make_cache(const KVCacheConfig& config, int layer_budget = -1,
                                    std::shared_ptr<SqueezeCoordinator> coordinator = nullptr, int layer_id = 0);

// Decode steps replayed as one CUDA graph: a framework's per-step host work (a Python forward pass
// of a few hundred kernel launches) replaced by one graph launch. The caller captures one decode
// step of its model, kvslim's caches included, into a CUDA graph -- torch.cuda.CUDAGraph(keep_graph
// = True) in kvslim.hf -- between begin_capture() and end_capture(); each replay() then runs one
// step. Captured inputs (the step's keys, values and queries, the attention output) must stay at
// their addresses, as any replayed graph's do; what moves between steps is the caches' own state
// (rows, kivi's window and groups, positions, split counts), and the caches set their kernels'
// arguments from it before every launch (cudaGraphExecKernelNodeSetParams), growing their storage
// outside the graph when a step needs it. Each step appends query_tokens new tokens at the next
// positions and attends them; an eviction cache ("h2o", "pyramidkv") also attends with
// probabilities and observes them, its decode kernel evicting a row per step, and is captured once
// it holds its budget (the probabilities' shape is fixed from then on). The caches must outlive the
// StepGraph and take no other call while a step is captured.
class StepGraph {
 public:
  explicit StepGraph(const std::vector<KVCache*>& caches);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // The caches' next append and attend -- once each, on a capturing stream -- become graph nodes.
  // The caches are left as after that step (capture runs nothing: the first replay() runs it).
  // Reserve the tokens the run needs first (KVCache::reserve): a captured step cannot allocate.
  void begin_capture(int query_heads, int query_tokens = 1);
  // graph: the captured cudaGraph_t (kept alive by the caller while this StepGraph is used).
  void end_capture(void* graph);
  // Runs the next step on `stream` (a cudaStream_t): the captured step first, then later ones.
  void replay(void* stream);
  // Whether the next step can be replayed. Enqueues on `stream` what the last replay left to the
  // host (what its eager twin did after its attention: a kivi window compressed), so ask before
  // every step. false: take that step eagerly through the caches (append, attend, observe), then
  // ask again -- a step whose cache decides on the host before it attends (streaming over kivi
  // codes compressing its window: the CPU cache's order) cannot be replayed. Before begin_capture
  // it says whether a step may be captured now.
  bool next_step_replays(void* stream);
  std::size_t steps() const;   // replays so far
  std::size_t nodes() const;   // the caches' kernel nodes in the graph

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvslim::cuda
