// Decode steps replayed as a CUDA graph (kvslim/cuda.h StepGraph) against the same steps run
// eagerly: one step captured on a stream, then hundreds of replays -- crossing kivi's window flushes
// and split-count changes, h2o's eviction of a row every step -- whose attention outputs (and h2o's
// probabilities), stored rows and positions equal, bit for bit, those of a twin cache fed the same
// steps without a graph. Misuse (caches without a replayable step, a
// capture that would have to allocate, a step that does not append and attend) is refused with a
// message naming it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <functional>
#include <execinfo.h>
#include <unistd.h>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_eviction_cache.h"
#include "cuda/device_packed_rows.h"
#include "kvslim/cuda.h"
#include "kvslim/errors.h"
#include "kvslim/kvslim.h"

namespace kvslim {
namespace {

// A host fault in this suite prints its stack (the device machine has no debugger): frame
// addresses resolve with addr2line against this binary.
void print_stack_and_exit(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}
const bool stack_on_fault = [] {
  std::signal(SIGSEGV, print_stack_and_exit);
  return true;
}();

using cuda::DeviceBuffer;

#define REQUIRE_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

std::vector<std::uint16_t> random_half(std::size_t n, std::mt19937& rng, DType t) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<std::uint16_t> x(n);
  for (auto& v : x) {
    const float f = d(rng);
    v = t == DType::bf16 ? f32_to_bf16(f) : f32_to_fp16(f);
  }
  return x;
}

std::vector<float> random_float(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

KVCacheConfig device_config(const std::string& method, int bits = 2, int value_bits = -1, int group = 32,
                            int budget = 64) {
  KVCacheConfig c;
  c.method = method;
  c.kivi_bits = bits;
  c.kivi_value_bits = value_bits;
  c.kivi_group_size = group;
  c.kivi_staging = std::max(128, group);
  c.h2o_budget = budget;
  c.streaming_budget = budget;
  c.device = "cuda";
  return c;
}

std::unique_ptr<KVCache> device_cache(const std::string& method, int bits = 2, int value_bits = -1, int group = 32,
                                     int budget = 64) {
  return KVCacheFactory::create(device_config(method, bits, value_bits, group, budget));
}

// A stream that outlives the caches using it (a cache waits for its stream when it is destroyed):
// declare it before them.
struct OwnStream {
  cudaStream_t s = nullptr;
  OwnStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~OwnStream() { cudaStreamDestroy(s); }
};

struct OwnGraph {  // a captured graph, destroyed after the StepGraph declared below it
  cudaGraph_t g = nullptr;
  ~OwnGraph() {
    if (g) cudaGraphDestroy(g);
  }
};

struct Shape {
  std::size_t B = 2, H = 2, Hq = 8, D = 128;
};

// One step's inputs at fixed device addresses (what a captured graph reads).
struct StepInputs {
  Shape s;
  DType dtype;
  DeviceBuffer k, v, q;
  StepInputs(const Shape& shape, DType t) : s(shape), dtype(t) {
    k.reserve(s.B * s.H * s.D * 2);
    v.reserve(s.B * s.H * s.D * 2);
    q.reserve(s.B * s.Hq * s.D * 4);
  }
  KVBlock keys(cudaStream_t st) const { return {k.get(), dtype, s.B, s.H, 1, s.D, MemorySpace::cuda, st}; }
  KVBlock values(cudaStream_t st) const { return {v.get(), dtype, s.B, s.H, 1, s.D, MemorySpace::cuda, st}; }
  QueryBlock queries(cudaStream_t st) const {
    return {q.as<float>(), s.B, 1, s.Hq, s.D, 0.f, MemorySpace::cuda, st};
  }
  void write(const std::vector<std::uint16_t>& hk, const std::vector<std::uint16_t>& hv, const std::vector<float>& hq,
             cudaStream_t st) {
    ASSERT_EQ(cudaMemcpyAsync(k.get(), hk.data(), hk.size() * 2, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(v.get(), hv.data(), hv.size() * 2, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(q.get(), hq.data(), hq.size() * 4, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);  // the host vectors may go
  }
};

// Whether a cache's first decode step must run eagerly before a capture without any observation:
// streaming over kivi codes (its first step on the device uploads the host's metadata).
bool steps_eagerly_first(const KVCache& c) {
  const auto* e = dynamic_cast<const cuda::DeviceEvictionCache*>(&c);
  return e != nullptr && !c.needs().attention && e->store().kind() == "kivi";
}

// A prompt of `rows` rows appended eagerly to both caches. An eviction cache then observes the
// prompt's last query (cut to its budget) and takes one eager decode step, as kvslim.hf's
// GraphDecoder does before it captures: the store keeps room for budget + 1 rows from then on.
// Streaming over kivi codes takes that eager step too (no observation), unless `eager_step` is off.
void prefill(const std::vector<KVCache*>& caches, const Shape& s, DType t, std::size_t rows, std::mt19937& rng,
             cudaStream_t st, bool eager_step = true) {
  KVCache& a = *caches.front();
  const std::size_t n = s.B * s.H * rows * s.D;
  const auto hk = random_half(n, rng, t), hv = random_half(n, rng, t);
  DeviceBuffer k, v;
  k.reserve(n * 2);
  v.reserve(n * 2);
  ASSERT_EQ(cudaMemcpy(k.get(), hk.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(v.get(), hv.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  for (KVCache* c : caches) {
    c->append({k.get(), t, s.B, s.H, rows, s.D, MemorySpace::cuda, st}, {v.get(), t, s.B, s.H, rows, s.D, MemorySpace::cuda, st});
  }
  if (eager_step && steps_eagerly_first(a)) {
    const std::int64_t next = static_cast<std::int64_t>(rows);
    const auto sk = random_half(s.B * s.H * s.D, rng, t), sv = random_half(s.B * s.H * s.D, rng, t);
    const auto hq = random_float(s.B * s.Hq * s.D, rng);
    DeviceBuffer dk, dv, q, out;
    dk.reserve(sk.size() * 2);
    dv.reserve(sv.size() * 2);
    q.reserve(hq.size() * 4);
    out.reserve(hq.size() * 4);
    ASSERT_EQ(cudaMemcpy(dk.get(), sk.data(), sk.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dv.get(), sv.data(), sv.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q.get(), hq.data(), hq.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    for (KVCache* c : caches) {
      c->append({dk.get(), t, s.B, s.H, 1, s.D, MemorySpace::cuda, st}, {dv.get(), t, s.B, s.H, 1, s.D, MemorySpace::cuda, st},
                {&next, 1});
      c->attend({q.as<float>(), s.B, 1, s.Hq, s.D, 0.f, MemorySpace::cuda, st}, {&next, 1}, out.as<float>());
    }
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);  // dk, dv, q and out die here
  }
  if (a.needs().attention) {  // an eviction cache: the prompt's last query observed, the cache cut to its budget
    const auto hq = random_float(s.B * s.Hq * s.D, rng);
    DeviceBuffer q, out, probs;
    q.reserve(hq.size() * 4);
    out.reserve(hq.size() * 4);
    probs.reserve(s.B * s.H * (rows + 1) * 4);  // the prompt's observation, then the step's (<= rows + 1)
    ASSERT_EQ(cudaMemcpy(q.get(), hq.data(), hq.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    const std::int64_t pos = static_cast<std::int64_t>(rows) - 1;
    for (KVCache* c : caches) {
      c->attend({q.as<float>(), s.B, 1, s.Hq, s.D, 0.f, MemorySpace::cuda, st}, {&pos, 1}, out.as<float>(),
                probs.as<float>());
      c->observe_attention(AttentionObservation{probs.as<float>(), s.B, s.H, 1, rows, rows, {&pos, 1},
                                                MemorySpace::cuda, st});
    }
    const std::size_t kept = a.rows() + 1;  // the decode step's rows before it evicts
    const std::int64_t next = static_cast<std::int64_t>(rows);
    const auto sk = random_half(s.B * s.H * s.D, rng, t), sv = random_half(s.B * s.H * s.D, rng, t);
    DeviceBuffer dk, dv;
    dk.reserve(sk.size() * 2);
    dv.reserve(sv.size() * 2);
    ASSERT_EQ(cudaMemcpy(dk.get(), sk.data(), sk.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dv.get(), sv.data(), sv.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    for (KVCache* c : caches) {
      c->append({dk.get(), t, s.B, s.H, 1, s.D, MemorySpace::cuda, st}, {dv.get(), t, s.B, s.H, 1, s.D, MemorySpace::cuda, st},
                {&next, 1});
      c->attend({q.as<float>(), s.B, 1, s.Hq, s.D, 0.f, MemorySpace::cuda, st}, {&next, 1}, out.as<float>(),
                probs.as<float>());
      c->observe_attention(AttentionObservation{probs.as<float>(), s.B, s.H, 1, kept, kept, {&next, 1},
                                                MemorySpace::cuda, st});
    }
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);  // dk, dv, q, out and probs die here
  }
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
}

void prefill(KVCache& a, KVCache& b, const Shape& s, DType t, std::size_t rows, std::mt19937& rng, cudaStream_t st,
             bool eager_step = true) {
  prefill(std::vector<KVCache*>{&a, &b}, s, t, rows, rng, st, eager_step);
}

// How a step's attention reaches its observation: attend with probabilities, then
// observe_attention of them; or KVCache::attend_and_observe, whose probabilities nobody reads.
enum class StepCalls { attend_then_observe, attend_and_observe };

// Replays of `config`'s cache against its eager twin; `after` inspects the replayed cache at the end.
// StepCalls::attend_and_observe: the replayed cache's step is captured through attend_and_observe,
// and a third cache takes the same steps eagerly through it; both must equal the twin's outputs,
// rows and views, and an eviction step observed on the device must leave their probabilities'
// workspace as it was (NaN bytes): nothing computes them into it.
void expect_replays_equal_eager(const KVCacheConfig& config, const std::string& name, DType t, std::size_t prompt,
                                int steps, const std::function<void(const KVCache&)>& after = {},
                                StepCalls calls = StepCalls::attend_then_observe);

void expect_replays_equal_eager(const std::string& method, int bits, DType t, std::size_t prompt, int steps,
                                int value_bits = -1, int group = 32, int budget = 64) {
  expect_replays_equal_eager(device_config(method, bits, value_bits, group, budget), method + (method == "kivi" ? std::to_string(bits) + "/" + std::to_string(value_bits) + " g" + std::to_string(group) : ""),
                             t, prompt, steps);
}

void expect_replays_equal_eager(const KVCacheConfig& config, const std::string& name, DType t, std::size_t prompt,
                                int steps, const std::function<void(const KVCache&)>& after, StepCalls calls) {
  const bool one_call = calls == StepCalls::attend_and_observe;
  const std::string what = name + " " + std::string(dtype_name(t)) + " prompt " + std::to_string(prompt) +
                           (one_call ? " (attend_and_observe)" : "");
  const Shape s;
  OwnStream stream;
  cudaStream_t st = stream.s;
  auto graphed = KVCacheFactory::create(config), eager = KVCacheFactory::create(config);
  // attend_and_observe: the same steps taken eagerly through it.
  std::unique_ptr<KVCache> eager_one = one_call ? KVCacheFactory::create(config) : nullptr;
  std::mt19937 rng(7 + prompt);
  std::vector<KVCache*> all{graphed.get(), eager.get()};
  if (eager_one) all.push_back(eager_one.get());
  prefill(all, s, t, prompt, rng, st);
  // the eviction cache's eager step
  const std::size_t first = prompt + (graphed->needs().attention || steps_eagerly_first(*graphed) ? 1 : 0);
  graphed->reserve(first + steps);

  StepInputs in(s, t);
  DeviceBuffer out_graph, out_eager, out_one, probs_graph, probs_eager, probs_one;
  const std::size_t out_n = s.B * s.Hq * s.D;
  for (DeviceBuffer* o : {&out_graph, &out_eager, &out_one}) o->reserve(out_n * 4);
  // Eviction: each step attends with probabilities over budget + 1 rows and observes them.
  const bool observes = graphed->needs().attention;
  const std::size_t prob_rows = graphed->rows() + 1, probs_n = s.B * s.H * prob_rows;
  for (DeviceBuffer* p : {&probs_graph, &probs_eager, &probs_one}) p->reserve(probs_n * 4);
  // Unread probabilities keep these bytes (a NaN pattern) where no kernel wrote them.
  constexpr unsigned char kUnwritten = 0xFF;
  if (one_call) {
    for (DeviceBuffer* p : {&probs_graph, &probs_one}) {
      ASSERT_EQ(cudaMemsetAsync(p->get(), kUnwritten, probs_n * 4, st), cudaSuccess);
    }
  }
  const auto step_calls = [&](KVCache& c, std::int64_t pos, DeviceBuffer& out, DeviceBuffer& probs, bool through_one) {
    c.append(in.keys(st), in.values(st), {&pos, 1});
    if (through_one) {
      c.attend_and_observe(in.queries(st), {&pos, 1}, out.as<float>(), observes ? probs.as<float>() : nullptr, s.H);
      return;
    }
    c.attend(in.queries(st), {&pos, 1}, out.as<float>(), observes ? probs.as<float>() : nullptr);
    if (observes) {
      c.observe_attention(AttentionObservation{probs.as<float>(), s.B, s.H, 1, prob_rows, prob_rows, {&pos, 1},
                                               MemorySpace::cuda, st});
    }
  };

  OwnGraph captured;
  cuda::StepGraph graph({graphed.get()});
  graph.begin_capture(static_cast<int>(s.Hq), 1);
  {
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), cudaSuccess);
    step_calls(*graphed, static_cast<std::int64_t>(first), out_graph, probs_graph, one_call);
    ASSERT_EQ(cudaStreamEndCapture(st, &captured.g), cudaSuccess);
  }
  graph.end_capture(captured.g);
  EXPECT_GT(graph.nodes(), 0u);

  const std::vector<unsigned char> unwritten(probs_n * 4, kUnwritten);
  std::vector<float> a(out_n), b(out_n), c1(out_n), pa(probs_n), pb(probs_n), pc(probs_n);
  std::size_t eager_steps = 0;  // the graphed cache's steps next_step_replays sent through the eager calls
  for (int step = 0; step < steps; ++step) {
    const auto hk = random_half(s.B * s.H * s.D, rng, t), hv = random_half(s.B * s.H * s.D, rng, t);
    const auto hq = random_float(out_n, rng);
    in.write(hk, hv, hq, st);
    const std::int64_t pos = static_cast<std::int64_t>(first) + step;
    if (graph.next_step_replays(st)) {
      graph.replay(st);
    } else {
      step_calls(*graphed, pos, out_graph, probs_graph, one_call);
      ++eager_steps;
    }
    ASSERT_EQ(cudaMemcpyAsync(a.data(), out_graph.get(), out_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(pa.data(), probs_graph.get(), probs_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
    step_calls(*eager, pos, out_eager, probs_eager, false);
    ASSERT_EQ(cudaMemcpyAsync(b.data(), out_eager.get(), out_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(pb.data(), probs_eager.get(), probs_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
    if (eager_one) {
      step_calls(*eager_one, pos, out_one, probs_one, true);
      ASSERT_EQ(cudaMemcpyAsync(c1.data(), out_one.get(), out_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(pc.data(), probs_one.get(), probs_n * 4, cudaMemcpyDeviceToHost, st), cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess) << what;
    ASSERT_EQ(std::memcmp(a.data(), b.data(), out_n * 4), 0) << what << ": step " << step << " differs from eager";
    if (observes && !one_call) {
      ASSERT_EQ(std::memcmp(pa.data(), pb.data(), probs_n * 4), 0) << what << ": probs of step " << step;
    }
    if (eager_one) {
      ASSERT_EQ(std::memcmp(c1.data(), b.data(), out_n * 4), 0) << what << ": eager attend_and_observe, step " << step;
      ASSERT_EQ(eager_one->rows(), eager->rows()) << what << " step " << step;
      if (observes) {
        ASSERT_EQ(std::memcmp(pa.data(), unwritten.data(), probs_n * 4), 0) << what << ": replayed step " << step
                                                                           << " wrote its unread probabilities";
        ASSERT_EQ(std::memcmp(pc.data(), unwritten.data(), probs_n * 4), 0) << what << ": eager step " << step
                                                                           << " wrote its unread probabilities";
      }
    }
    ASSERT_EQ(graphed->rows(), eager->rows()) << what << " step " << step;
  }
  EXPECT_EQ(graph.steps() + eager_steps, static_cast<std::size_t>(steps)) << what;
  if (steps_eagerly_first(*graphed)) {
    // streaming over kivi codes: the steps that compress the window (one in `staging`) run eagerly
    EXPECT_GT(eager_steps, 0u) << what;
    EXPECT_GT(graph.steps(), 4 * eager_steps) << what;
  } else {
    EXPECT_EQ(eager_steps, 0u) << what;
  }
  const CacheView vb = eager->materialize();
  const auto expect_view_equal = [&](const KVCache& cache, const std::string& who) {
    const CacheView va = cache.materialize();
    ASSERT_EQ(va.tokens, vb.tokens) << who;
    for (std::size_t bh = 0; bh < s.B * s.H; ++bh) {
      EXPECT_EQ(std::memcmp(va.keys + bh * va.head_stride * s.D, vb.keys + bh * vb.head_stride * s.D, va.tokens * s.D * 2), 0)
          << who << " keys of head " << bh;
      EXPECT_EQ(std::memcmp(va.values + bh * va.head_stride * s.D, vb.values + bh * vb.head_stride * s.D,
                            va.tokens * s.D * 2), 0)
          << who << " values of head " << bh;
      EXPECT_EQ(std::memcmp(va.positions + bh * va.head_stride, vb.positions + bh * vb.head_stride, va.tokens * 8), 0)
          << who << " positions of head " << bh;
    }
  };
  expect_view_equal(*graphed, what);
  if (eager_one) expect_view_equal(*eager_one, what + ", eager");
  if (after) after(*graphed);
}

TEST(CudaStepGraph, FullReplaysEqualEagerSteps) {
  REQUIRE_GPU();
  expect_replays_equal_eager("full", 2, DType::f16, 300, 200);
  expect_replays_equal_eager("full", 2, DType::bf16, 37, 120);
}

TEST(CudaStepGraph, KiviReplaysEqualEagerStepsAcrossFlushes) {
  REQUIRE_GPU();
  // staging 128: a flush every 32 steps once the window is full, the first at the prompt's edge.
  expect_replays_equal_eager("kivi", 2, DType::bf16, 300, 300);
  expect_replays_equal_eager("kivi", 4, DType::f16, 127, 200);
  expect_replays_equal_eager("kivi", 8, DType::bf16, 5, 90);  // codes appear during the replays
  // Keys at 4 bits, values at 2, groups of 128 rows (staging 128): a whole group per flush.
  expect_replays_equal_eager("kivi", 4, DType::bf16, 200, 300, 2, 128);
}

TEST(CudaStepGraph, ZipcacheReplaysEqualEagerStepsAcrossBlocks) {
  REQUIRE_GPU();
  // zipcache at its defaults (staging 128, groups of 32): a block every 128 steps, its norms,
  // selection and quantization three nodes switched on in that step; the sets grow by reserve().
  expect_replays_equal_eager("zipcache", 2, DType::bf16, 300, 300);
  expect_replays_equal_eager("zipcache", 2, DType::f16, 5, 140);  // the first block during the replays
}

TEST(CudaStepGraph, EvictionReplaysEqualEagerSteps) {
  REQUIRE_GPU();
  // h2o keeping 64 rows per head: every step appends a row, attends over 65 with probabilities and
  // the decode kernel evicts the lowest; the moves, scores and victims equal the eager twin's.
  expect_replays_equal_eager("h2o", 2, DType::bf16, 300, 150);
  expect_replays_equal_eager("h2o", 2, DType::f16, 64, 100);  // the prompt is the budget: nothing evicted before
  // 2,501 rows a step: each head's observation split across CTAs, re-armed every replay.
  expect_replays_equal_eager("h2o", 2, DType::bf16, 3000, 60, -1, 32, 2500);
  // streaming keeping 64 rows: every step's new row takes the oldest non-sink row's slot, the
  // same in every head (one kernel whose arguments the replay updates).
  expect_replays_equal_eager("streaming", 2, DType::bf16, 300, 150);
}

// h2o over kivi codes (DevicePackedRows): each replayed step appends to the fp16 window, attends
// over the groups' codes and the window, and the decode kernel evicts one row a head, from a group
// (the later rows move down) or from the window (masked). What an eager step's observation settles
// -- the window compressed once `staging` rows wait, heads whose groups thinned re-packed, a store
// re-laid out -- runs between two replays, on the stream ahead of the next; the victims are read
// when the host next needs them. The replays equal the eager twin to the bit: outputs,
// probabilities, the rows' decoded keys and values and their positions.
KVCacheConfig codes_config(int key_bits, int value_bits, int group, int staging, std::size_t budget) {
  KVCacheConfig c;
  c.method = "h2o";
  c.h2o_budget = static_cast<int>(budget);
  c.storage = "kivi";
  c.kivi_key_bits = key_bits;
  c.kivi_value_bits = value_bits;
  c.kivi_group_size = group;
  c.kivi_staging = staging;
  c.device = "cuda";
  return c;
}

TEST(CudaStepGraph, EvictionOverKiviCodesReplaysEqualEagerSteps) {
  REQUIRE_GPU();
  const auto store_of = [](const KVCache& c) -> const cuda::DevicePackedRows& {
    return dynamic_cast<const cuda::DevicePackedRows&>(dynamic_cast<const cuda::DeviceEvictionCache&>(c).store());
  };
  // Keys at 4 bits, values at 2, groups of 32, a window compressed every 32 rows; decayed scores
  // reach back into old groups, so heads are re-packed during the replays.
  {
    KVCacheConfig c = codes_config(4, 2, 32, 32, 64);
    c.evict_recent_window = 8;
    c.evict_decay = 0.8;
    expect_replays_equal_eager(c, "h2o over kivi K4V2 g32 (decayed)", DType::bf16, 300, 500, [&](const KVCache& cache) {
      std::size_t repacks = 0, blocks = 0;
      for (const auto& h : store_of(cache).heads()) {
        repacks += h.repacks;
        blocks += h.blocks.size();
      }
      EXPECT_GT(repacks, 0u) << "no head was re-packed during the replays";
      EXPECT_GT(blocks, 0u);
      EXPECT_EQ(cache.stats().figure("decode_steps_on_device"), 501.0);  // the eager step and 500 replays
    });
  }
  // A window shorter than a group (one short group per compression), 2-bit keys and values.
  expect_replays_equal_eager(codes_config(2, 2, 64, 16, 96), "h2o over kivi K2V2 g64 staging 16", DType::bf16, 200, 200);
  // zipcache codes (two sets a group) under h2o, re-packed during the replays as kivi's are.
  {
    KVCacheConfig c = codes_config(4, 2, 32, 32, 64);
    c.storage = "zipcache";
    c.zipcache_hi_bits = 4;
    c.zipcache_lo_bits = 2;
    c.zipcache_value_bits = 4;
    c.zipcache_hi_fraction = 0.5;
    c.zipcache_group_size = 32;
    c.zipcache_staging = 32;
    c.evict_recent_window = 8;
    c.evict_decay = 0.8;
    expect_replays_equal_eager(c, "h2o over zipcache 4/2 g32 (decayed)", DType::bf16, 300, 300, [&](const KVCache& cache) {
      std::size_t repacks = 0;
      for (const auto& h : store_of(cache).heads()) repacks += h.repacks;
      EXPECT_GT(repacks, 0u) << "no head was re-packed during the replays";
      EXPECT_EQ(cache.stats().figure("decode_steps_on_device"), 301.0);
    });
  }
  // streaming over kivi codes: each replayed step's row admitted on the device (the decode
  // observation by position erases the oldest row after the sinks), the window compressed between
  // replays; groups emptied by the sliding window leave the store.
  for (const auto& [k, v, g, staging, budget] : {std::tuple{4, 2, 32, 32, 64}, std::tuple{2, 2, 64, 16, 96}}) {
    KVCacheConfig c = codes_config(k, v, g, staging, budget);
    c.method = "streaming";
    c.streaming_budget = budget;
    const int steps = 300;
    const std::size_t kept = static_cast<std::size_t>(budget);
    expect_replays_equal_eager(c, "streaming over kivi K" + std::to_string(k) + "V" + std::to_string(v) + " g" +
                                      std::to_string(g) + " staging " + std::to_string(staging),
                               DType::bf16, 200, steps, [&](const KVCache& cache) {
                                 EXPECT_EQ(cache.rows(), kept);
                                 // the eager step and the replays
                                 EXPECT_EQ(cache.stats().figure("decode_steps_on_device"), steps + 1.0);
                                 std::size_t blocks = 0;
                                 for (const auto& h : store_of(cache).heads()) blocks += h.blocks.size();
                                 EXPECT_GT(blocks, 0u);
                               });
  }
}

TEST(CudaStepGraph, EvictionOverKiviCodesReplaysLargerStores) {
  REQUIRE_GPU();
  // kivi's default widths and group (K4V2 g128, staging 128) over 512 kept rows: whole groups.
  expect_replays_equal_eager(codes_config(4, 2, 128, 128, 512), "h2o over kivi K4V2 g128", DType::f16, 1000, 300);
  // 2,501 rows a step: each head's observation split across CTAs.
  expect_replays_equal_eager(codes_config(4, 2, 128, 128, 2500), "h2o over kivi K4V2 g128, 2,500 rows", DType::bf16,
                             3000, 80);
  // 20,001 rows over 4 heads: 16 parts a head of ~1,250 rows, each scored in two chunks.
  expect_replays_equal_eager(codes_config(4, 2, 128, 128, 20000), "h2o over kivi K4V2 g128, 20,000 rows", DType::bf16,
                             20500, 30);
}

// attend_and_observe (kvslim.hf's attention step): a decode step's probabilities are scored inside
// the observation and written nowhere, replayed and eager, over fp16 slots and over kivi codes
// (no slot-order scan), with the rows, outputs and views of attend + observe_attention.
TEST(CudaStepGraph, AttendAndObserveScoresWithoutWritingProbabilities) {
  REQUIRE_GPU();
  const StepCalls one = StepCalls::attend_and_observe;
  expect_replays_equal_eager(device_config("h2o"), "h2o", DType::bf16, 300, 150, {}, one);
  expect_replays_equal_eager(device_config("h2o", 2, -1, 32, 2500), "h2o, 2,500 rows", DType::bf16, 3000, 60, {}, one);
  expect_replays_equal_eager(device_config("streaming"), "streaming", DType::bf16, 300, 60, {}, one);  // observes nothing
  {
    KVCacheConfig c = codes_config(4, 2, 32, 32, 64);
    c.evict_recent_window = 8;
    c.evict_decay = 0.8;
    expect_replays_equal_eager(c, "h2o over kivi K4V2 g32 (decayed)", DType::bf16, 300, 300, {}, one);
  }
}

TEST(CudaStepGraph, AttendAndObserveOverLargerStores) {
  REQUIRE_GPU();
  const StepCalls one = StepCalls::attend_and_observe;
  expect_replays_equal_eager(codes_config(4, 2, 128, 128, 2500), "h2o over kivi K4V2 g128, 2,500 rows", DType::bf16,
                             3000, 60, {}, one);
  // 16 parts a head of ~1,250 rows: the four-rows-a-thread kernel, two chunks a part.
  expect_replays_equal_eager(codes_config(4, 2, 128, 128, 20000), "h2o over kivi K4V2 g128, 20,000 rows", DType::bf16,
                             20500, 20, {}, one);
}

TEST(CudaStepGraph, RefusesWhatItCannotReplay) {
  REQUIRE_GPU();
  // An eviction cache below its budget: its probabilities would change shape every step.
  const Shape s;
  OwnStream stream;
  cudaStream_t st = stream.s;
  {
    auto h2o = device_cache("h2o"), twin = device_cache("h2o");
    std::mt19937 rng(5);
    prefill(*h2o, *twin, s, DType::f16, 40, rng, st);
    cuda::StepGraph g({h2o.get()});
    try {
      g.begin_capture(static_cast<int>(s.Hq), 1);
      FAIL() << "an h2o cache below its budget was captured";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
    }
  }
  {
    // streaming over kivi codes at its budget before any decode step on the device: its first one
    // uploads the host's metadata, a copy no capture may hold.
    KVCacheConfig c = codes_config(4, 2, 32, 32, 64);
    c.method = "streaming";
    c.streaming_budget = 64;
    auto streaming = KVCacheFactory::create(c), twin = KVCacheFactory::create(c);
    std::mt19937 rng(6);
    prefill(*streaming, *twin, s, DType::f16, 200, rng, st, /*eager_step=*/false);
    ASSERT_EQ(streaming->rows(), 64u);
    cuda::StepGraph g({streaming.get()});
    try {
      g.begin_capture(static_cast<int>(s.Hq), 1);
      FAIL() << "streaming over kivi codes was captured";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("eagerly"), std::string::npos) << e.what();
    }
    // Eager steps on the device up to the one that compresses its window before it attends: that
    // step is not replayable, and no capture takes it.
    StepInputs in(s, DType::f16);
    DeviceBuffer out;
    out.reserve(s.B * s.Hq * s.D * 4);
    std::int64_t pos = 200;
    int eager = 0;
    for (; eager < 40 && (eager == 0 || g.next_step_replays(st)); ++eager, ++pos) {
      in.write(random_half(s.B * s.H * s.D, rng, DType::f16), random_half(s.B * s.H * s.D, rng, DType::f16),
               random_float(s.B * s.Hq * s.D, rng), st);
      streaming->append(in.keys(st), in.values(st), {&pos, 1});
      streaming->attend(in.queries(st), {&pos, 1}, out.as<float>());
    }
    ASSERT_LT(eager, 40) << "no step of a window of 32 compressed it";
    try {
      g.begin_capture(static_cast<int>(s.Hq), 1);
      FAIL() << "streaming over kivi codes was captured at a step that compresses its window";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("compresses"), std::string::npos) << e.what();
    }
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  }
  KVCacheConfig host;
  host.method = "kivi";
  auto cpu = KVCacheFactory::create(host);
  EXPECT_THROW(cuda::StepGraph({cpu.get()}), InputError);
  EXPECT_THROW(cuda::StepGraph(std::vector<KVCache*>{}), InputError);

  // An empty cache has no shape to capture.
  auto empty = device_cache("full");
  cuda::StepGraph g_empty({empty.get()});
  EXPECT_THROW(g_empty.begin_capture(8, 1), InputError);

  // A capture whose step would grow the storage (nothing reserved) is refused before it allocates.
  auto full = device_cache("full"), twin = device_cache("full");
  std::mt19937 rng(3);
  prefill(*full, *twin, s, DType::f16, 256, rng, st);  // capacity exactly 256 rows
  cuda::StepGraph g({full.get()});
  g.begin_capture(static_cast<int>(s.Hq), 1);
  StepInputs in(s, DType::f16);
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), cudaSuccess);
  const std::int64_t pos = 256;
  try {
    full->append(in.keys(st), in.values(st), {&pos, 1});
    ADD_FAILURE() << "a capture that must grow the storage was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("reserve"), std::string::npos) << e.what();
  }
  cudaGraph_t captured = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(st, &captured), cudaSuccess);
  // The step neither appended nor attended through the cache: end_capture says so.
  EXPECT_THROW(g.end_capture(captured), InputError);
  if (captured) cudaGraphDestroy(captured);
}

}  // namespace
}  // namespace kvslim
