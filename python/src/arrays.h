// numpy <-> kvslim tensors for the Python binding: input arrays checked and wrapped as KVBlocks
// without copying, views handed out as numpy arrays over the cache's own memory.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "kvslim/block.h"
#include "kvslim/cache.h"

namespace kvslim::python {

namespace py = pybind11;

// A C-contiguous [B, H, S, D] array as a KVBlock over the array's own memory (no copy).
// Element type: float32 -> f32, float16 -> f16, 2-byte integers carry raw fp16/bf16 bits and need
// `dtype` ("f16" or "bf16"; torch bf16 tensors arrive this way). Throws InputError naming `name`.
KVBlock as_block(const py::array& a, const std::string& dtype, const char* name);

// The view as numpy arrays. copy=true: fresh arrays owning a copy, made here while the GIL is
// held (a copy made later in Python could run while another thread changes the cache: issue 26).
// copy=false: arrays that alias the cache's storage (`owner` keeps the cache alive; the memory is
// only valid until the next mutating call, which the Python View checks).
// Returns (keys fp16 [B, H, T, D], values fp16 [B, H, T, D], positions int64 [B, H, T]).
py::tuple view_arrays(const CacheView& v, py::handle owner, bool copy);

}  // namespace kvslim::python
