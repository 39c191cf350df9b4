#include "arrays.h"

#include <cstring>

#include <vector>

#include "kvslim/errors.h"

namespace kvslim::python {

namespace {

DType element_type(const py::array& a, const std::string& dtype, const char* name) {
  const char kind = a.dtype().kind();
  const auto size = a.dtype().itemsize();
  if (kind == 'f' && size == 4) {
    if (!dtype.empty() && dtype != "f32") throw InputError(std::string(name) + ": float32 array but dtype \"" + dtype + "\"");
    return DType::f32;
  }
  if (kind == 'f' && size == 2) {
    if (!dtype.empty() && dtype != "f16") throw InputError(std::string(name) + ": float16 array but dtype \"" + dtype + "\"");
    return DType::f16;
  }
  if ((kind == 'u' || kind == 'i') && size == 2) {
    if (dtype == "f16") return DType::f16;
    if (dtype == "bf16") return DType::bf16;
    throw InputError(std::string(name) + ": a 16-bit integer array carries raw fp16/bf16 bits and needs dtype \"f16\" or \"bf16\"");
  }
  throw InputError(std::string(name) + ": element type " + std::string(py::str(a.dtype())) +
                   " is not float32, float16 or bfloat16");
}

}  // namespace

KVBlock as_block(const py::array& a, const std::string& dtype, const char* name) {
  if (a.ndim() != 4) {
    throw InputError(std::string(name) + ": expected 4 dimensions [batch, kv_heads, tokens, head_dim], got " +
                     std::to_string(a.ndim()));
  }
  if (!(a.flags() & py::array::c_style)) throw InputError(std::string(name) + ": array is not C-contiguous");
  KVBlock b;
  b.data = a.data();
  b.dtype = element_type(a, dtype, name);
  b.batch = static_cast<std::size_t>(a.shape(0));
  b.heads = static_cast<std::size_t>(a.shape(1));
  b.tokens = static_cast<std::size_t>(a.shape(2));
  b.head_dim = static_cast<std::size_t>(a.shape(3));
  return b;
}

py::tuple view_arrays(const CacheView& v, py::handle owner, bool copy) {
  const auto B = static_cast<py::ssize_t>(v.batch), H = static_cast<py::ssize_t>(v.heads);
  const auto T = static_cast<py::ssize_t>(v.tokens), D = static_cast<py::ssize_t>(v.head_dim);
  const auto hs = static_cast<py::ssize_t>(v.head_stride);
  const py::dtype f16("float16");
  if (T == 0 || v.keys == nullptr) {  // empty view: fresh zero-size arrays (no pointer to alias)
    return py::make_tuple(py::array(f16, std::vector<py::ssize_t>{B, H, 0, D}),
                          py::array(f16, std::vector<py::ssize_t>{B, H, 0, D}),
                          py::array_t<std::int64_t>(std::vector<py::ssize_t>{B, H, 0}));
  }
  // Rows of head (b, h) start at (b * H + h) * head_stride; only the first `tokens` are valid.
  if (copy) {
    py::array keys(f16, std::vector<py::ssize_t>{B, H, T, D});
    py::array values(f16, std::vector<py::ssize_t>{B, H, T, D});
    py::array_t<std::int64_t> positions(std::vector<py::ssize_t>{B, H, T});
    auto* k = static_cast<std::uint16_t*>(keys.mutable_data());
    auto* val = static_cast<std::uint16_t*>(values.mutable_data());
    std::int64_t* p = positions.mutable_data();
    for (py::ssize_t bh = 0; bh < B * H; ++bh) {
      std::memcpy(k + bh * T * D, v.keys + bh * hs * D, static_cast<std::size_t>(T * D) * 2);
      std::memcpy(val + bh * T * D, v.values + bh * hs * D, static_cast<std::size_t>(T * D) * 2);
      std::memcpy(p + bh * T, v.positions + bh * hs, static_cast<std::size_t>(T) * 8);
    }
    return py::make_tuple(keys, values, positions);
  }
  const std::vector<py::ssize_t> kv_shape{B, H, T, D};
  const std::vector<py::ssize_t> kv_strides{H * hs * D * 2, hs * D * 2, D * 2, 2};
  const std::vector<py::ssize_t> pos_shape{B, H, T};
  const std::vector<py::ssize_t> pos_strides{H * hs * 8, hs * 8, 8};
  py::array keys(f16, kv_shape, kv_strides, v.keys, owner);
  py::array values(f16, kv_shape, kv_strides, v.values, owner);
  py::array positions(py::dtype::of<std::int64_t>(), pos_shape, pos_strides, v.positions, owner);
  // Read-only: the storage belongs to the cache.
  for (py::array* a : {&keys, &values, &positions}) a->attr("setflags")(py::arg("write") = false);
  return py::make_tuple(keys, values, positions);
}

}  // namespace kvslim::python
