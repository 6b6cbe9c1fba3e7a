#include "core/storage.h"

#include <cstdlib>
#include <new>

#include "core/error.h"

namespace halfgrad {

namespace {
// 64-byte alignment: a cache line, and the width of an AVX-512 vector.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device) override {
    if (nbytes == 0) return nullptr;
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) HG_FAIL("cpu allocator: out of memory allocating {} bytes", nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t, Device) override { std::free(ptr); }
};

CpuAllocator cpu_allocator;
Allocator* allocators[kNumDeviceTypes] = {&cpu_allocator, nullptr};
}  // namespace

Allocator* allocator_for(Device device) {
  Allocator* a = allocators[int(device.type)];
  HG_CHECK(a != nullptr, "device {} is not available: halfgrad was built without its backend", device.str());
  return a;
}

void set_allocator(DeviceType type, Allocator* allocator) { allocators[int(type)] = allocator; }

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = allocator_for(device)->allocate(nbytes, device);
}

Storage::~Storage() {
  if (data_) allocator_for(device_)->deallocate(data_, nbytes_, device_);
}

}  // namespace halfgrad
