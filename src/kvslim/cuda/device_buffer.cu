#include "cuda/device_buffer.h"

#include <string>

#include "cuda/cuda_common.cuh"

namespace kvslim::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  const std::string what = std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                           ") in " + call + " at " + file + ":" + std::to_string(line);
  throw std::runtime_error(what);
}

void DeviceBuffer::reserve(std::size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_) return;
  release();
  KVSLIM_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  bytes_ = bytes;
  KVSLIM_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, bytes, stream));
}

void DeviceBuffer::upload(const void* host, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  reserve(bytes, stream);
  KVSLIM_CUDA_CHECK(cudaMemcpyAsync(ptr_, host, bytes, cudaMemcpyHostToDevice, stream));
}

void DeviceBuffer::release() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // cannot fail on a pointer cudaMalloc gave (errors are sticky context errors)
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceGuard::DeviceGuard(int device) {
  KVSLIM_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    KVSLIM_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

}  // namespace kvslim::cuda
