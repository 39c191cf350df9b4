// Device (CUDA) tensors for the Python binding: the Python side hands over raw device pointers,
// shapes and torch's current stream (torch tensors, zero-copy); these methods build the device
// KVBlock / QueryBlock and call the cache, which enqueues its kernels on that stream.
#pragma once
#include <pybind11/pybind11.h>

#include "kvslim/cache.h"

namespace kvslim::python {

// Cache.append_device, Cache.attend_device; module cuda_built(), cuda_device_count(),
// cuda_device_description().
void bind_device_methods(pybind11::module_& m, pybind11::class_<KVCache>& cache_class);

}  // namespace kvslim::python
