// GPU memory owned by one object: plain cudaMalloc allocations (never managed memory), freed on
// destruction, grown by copying what is kept.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace kvslim::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    DeviceBuffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  void swap(DeviceBuffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }

  // At least `bytes`, contents not kept (zero-filled when newly allocated, so a kernel that reads a
  // whole tile past the live rows never meets NaN bit patterns). The zero-fill is ordered on
  // `stream`: the legacy default stream does not order against a non-blocking stream (torch's side
  // streams), where a late zero-fill could overwrite what the caller's first kernel wrote.
  void reserve(std::size_t bytes, cudaStream_t stream = cudaStreamLegacy);
  void release();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }
  // `bytes` from host memory at the front of the buffer, grown to fit (contents not kept), on
  // `stream`. From pageable memory the call returns once the data is staged: the caller may reuse
  // it at once (a job list recorded on the host, copied ahead of the kernel that reads it).
  void upload(const void* host, std::size_t bytes, cudaStream_t stream);

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Selects `device` for the calling thread for the lifetime of the guard (kvslim never leaves the
// caller's current device changed).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

}  // namespace kvslim::cuda
