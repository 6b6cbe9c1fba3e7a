#pragma once
// Storage: one reference-counted block of device memory that tensors (and their views) share.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/device.h"

namespace halfgrad {

// A device's memory allocator. The CPU one is 64-byte aligned malloc; the CUDA one is the caching
// allocator of the CUDA backend, which registers itself at start-up (see set_allocator).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes, Device device) = 0;
  virtual void deallocate(void* ptr, size_t nbytes, Device device) = 0;
};

Allocator* allocator_for(Device device);  // throws if the device type has no backend in this build
void set_allocator(DeviceType type, Allocator* allocator);

class Storage {
 public:
  Storage(size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // The version counter that autograd reads: every in-place write to any view of this storage bumps it,
  // so a tensor saved for backward can tell that it was overwritten afterwards.
  uint64_t version() const { return version_; }
  void bump_version() { ++version_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  uint64_t version_ = 0;
};

}  // namespace halfgrad
