// A heap array whose elements start uninitialised: cache storage is always written before it is
// read, and zero-filling megabytes on every growth showed up as a third of prefill time.
#pragma once
#include <cstddef>
#include <memory>

namespace kvslim {

template <typename T>
class UninitBuffer {
 public:
  UninitBuffer() = default;
  explicit UninitBuffer(std::size_t n) : data_(n ? new T[n] : nullptr), size_(n) {}  // default-init: no fill
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  void release() {
    data_.reset();
    size_ = 0;
  }

 private:
  std::unique_ptr<T[]> data_;
  std::size_t size_ = 0;
};

}  // namespace kvslim
