#include "device_arrays.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvslim/cuda.h"
#include "kvslim/errors.h"

namespace kvslim::python {
namespace {

namespace py = pybind11;
using Positions = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

DType dtype_of(const std::string& name, const char* what) {
  if (name == "f32") return DType::f32;
  if (name == "f16") return DType::f16;
  if (name == "bf16") return DType::bf16;
  throw InputError(std::string(what) + ": element type \"" + name + "\" is not f32, f16 or bf16");
}

std::vector<std::size_t> shape4(const std::vector<std::int64_t>& shape, const char* what) {
  if (shape.size() != 4) throw InputError(std::string(what) + ": expected 4 dimensions");
  std::vector<std::size_t> out;
  for (std::int64_t d : shape) {
    if (d < 0) throw InputError(std::string(what) + ": negative dimension");
    out.push_back(static_cast<std::size_t>(d));
  }
  return out;
}

}  // namespace

void bind_device_methods(py::module_& m, py::class_<KVCache>& cls) {
  m.def("cuda_built", &cuda::built, "Whether this kvslim has its CUDA caches and kernels.");
  m.def("cuda_device_count", &cuda::device_count, "GPUs kvslim can use (0 without CUDA or a GPU).");
  m.def("cuda_device_description", &cuda::device_description, py::arg("device") = 0);
  // keys / values: device pointers of contiguous [B, H, S, D] tensors of `dtype` ("f32", "f16",
  // "bf16"); stream: the cudaStream_t (as an int) the caller's work on them is ordered on.
  cls.def(
      "append_device",
      [](KVCache& c, std::uintptr_t keys, std::uintptr_t values, const std::vector<std::int64_t>& shape,
         const std::string& dtype, const std::optional<Positions>& positions, std::uintptr_t stream) {
        const auto s = shape4(shape, "keys");
        const DType t = dtype_of(dtype, "keys");
        const auto* st = reinterpret_cast<void*>(stream);
        const KVBlock k{reinterpret_cast<const void*>(keys), t, s[0], s[1], s[2], s[3], MemorySpace::cuda,
                        const_cast<void*>(st)};
        KVBlock v = k;
        v.data = reinterpret_cast<const void*>(values);
        std::span<const std::int64_t> p;
        if (positions) {
          if (positions->ndim() != 1) throw InputError("positions: expected a 1-D array of int64 positions");
          p = {positions->data(), static_cast<std::size_t>(positions->shape(0))};
        }
        c.append(k, v, p);
      },
      py::arg("keys"), py::arg("values"), py::arg("shape"), py::arg("dtype"), py::arg("positions") = py::none(),
      py::arg("stream") = 0);
  // queries: device fp32 [B, S, H_q, D]; out: device fp32 [B, S, H_q, D]; probs: 0 or device fp32
  // [B, H_kv, S, rows()].
  cls.def(
      "attend_device",
      [](const KVCache& c, std::uintptr_t queries, const std::vector<std::int64_t>& shape,
         const Positions& query_positions, float scale, std::uintptr_t out, std::uintptr_t probs,
         std::uintptr_t stream) {
        const auto s = shape4(shape, "queries");
        if (query_positions.ndim() != 1) throw InputError("query_positions: expected a 1-D array of int64 positions");
        const QueryBlock q{reinterpret_cast<const float*>(queries), s[0], s[1], s[2], s[3], scale, MemorySpace::cuda,
                           reinterpret_cast<void*>(stream)};
        c.attend(q, {query_positions.data(), static_cast<std::size_t>(query_positions.shape(0))},
                 reinterpret_cast<float*>(out), reinterpret_cast<float*>(probs));
      },
      py::arg("queries"), py::arg("shape"), py::arg("query_positions"), py::arg("scale"), py::arg("out"),
      py::arg("probs") = 0, py::arg("stream") = 0);
  // attend_device and observe_attention_device of its probabilities, which nobody else reads
  // (KVCache::attend_and_observe): probs is device fp32 workspace [B, H_kv, S, rows()] whose
  // contents are unspecified afterwards (0 for a cache that observes nothing).
  cls.def(
      "attend_and_observe_device",
      [](KVCache& c, std::uintptr_t queries, const std::vector<std::int64_t>& shape, const Positions& query_positions,
         float scale, std::uintptr_t out, std::uintptr_t probs, std::size_t kv_heads, std::uintptr_t stream) {
        const auto s = shape4(shape, "queries");
        if (query_positions.ndim() != 1) throw InputError("query_positions: expected a 1-D array of int64 positions");
        const QueryBlock q{reinterpret_cast<const float*>(queries), s[0], s[1], s[2], s[3], scale, MemorySpace::cuda,
                           reinterpret_cast<void*>(stream)};
        c.attend_and_observe(q, {query_positions.data(), static_cast<std::size_t>(query_positions.shape(0))},
                             reinterpret_cast<float*>(out), reinterpret_cast<float*>(probs), kv_heads);
      },
      py::arg("queries"), py::arg("shape"), py::arg("query_positions"), py::arg("scale"), py::arg("out"),
      py::arg("probs"), py::arg("kv_heads"), py::arg("stream") = 0);
  // Decode steps replayed as one CUDA graph (kvslim/cuda.h StepGraph; kvslim.hf.GraphDecoder).
  // caches: the model's device caches (their Python objects are kept alive by this one); graph
  // and stream: the cudaGraph_t / cudaStream_t handles as ints (torch's raw_cuda_graph(),
  // cuda_stream).
  py::class_<cuda::StepGraph>(m, "StepGraph")
      .def(py::init([](const std::vector<KVCache*>& caches) { return std::make_unique<cuda::StepGraph>(caches); }),
           py::arg("caches"), py::keep_alive<1, 2>())
      .def("begin_capture", &cuda::StepGraph::begin_capture, py::arg("query_heads"), py::arg("query_tokens") = 1)
      .def(
          "end_capture",
          [](cuda::StepGraph& g, std::uintptr_t graph) { g.end_capture(reinterpret_cast<void*>(graph)); },
          py::arg("graph"))
      .def(
          "replay", [](cuda::StepGraph& g, std::uintptr_t stream) { g.replay(reinterpret_cast<void*>(stream)); },
          py::arg("stream"))
      .def(
          "next_step_replays",
          [](cuda::StepGraph& g, std::uintptr_t stream) { return g.next_step_replays(reinterpret_cast<void*>(stream)); },
          py::arg("stream"))
      .def_property_readonly("steps", &cuda::StepGraph::steps)
      .def_property_readonly("nodes", &cuda::StepGraph::nodes);
  // probs: device fp32 [B, H_kv, Q, T] (attend_device's), observed by a device cache (which copies
  // them to the host on `stream` when its policy runs there: device eviction).
  cls.def(
      "observe_attention_device",
      [](KVCache& c, std::uintptr_t probs, const std::vector<std::int64_t>& shape, const Positions& query_positions,
         std::uintptr_t stream) {
        const auto s = shape4(shape, "probs");
        if (query_positions.ndim() != 1 || static_cast<std::size_t>(query_positions.shape(0)) != s[2]) {
          throw InputError("query_positions: expected " + std::to_string(s[2]) + " positions (one per query)");
        }
        c.observe_attention(AttentionObservation{reinterpret_cast<const float*>(probs), s[0], s[1], s[2], s[3], s[3],
                                                 {query_positions.data(), s[2]}, MemorySpace::cuda,
                                                 reinterpret_cast<void*>(stream)});
      },
      py::arg("probs"), py::arg("shape"), py::arg("query_positions"), py::arg("stream") = 0);
}

}  // namespace kvslim::python
