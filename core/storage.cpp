#include "core/storage.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <new>

#include "core/error.h"
#include "core/log.h"

namespace halfgrad {

namespace {

constexpr size_t kCacheMin = size_t(1) << 20;  // smaller blocks are malloc's business (its bins reuse them)
constexpr size_t kDefaultLimit = size_t(1) << 30;

// The size class of a request: 64-byte multiples below kCacheMin; above, rounded up to a multiple of 1/8 of its
// power of two (1 MiB + 1 byte -> 1.125 MiB), so that sizes that differ a little share blocks.
size_t size_class(size_t nbytes) {
  if (nbytes < kCacheMin) return (nbytes + 63) / 64 * 64;
  size_t power = kCacheMin;
  while (power * 2 <= nbytes) power *= 2;  // (allocate refuses requests past PTRDIFF_MAX: power * 2 cannot wrap)
  const size_t step = power / 8;
  return (nbytes + step - 1) / step * step;
}

// Read where an exception must not escape (a Storage's destructor frees through it): a bad value is reported and
// the default kept.
size_t limit_from_environment() {
  const char* mb = std::getenv("HALFGRAD_CPU_CACHE_MB");
  if (mb == nullptr || *mb == '\0') return kDefaultLimit;
  // Digits only: strtoull would take "-1" as 2^64 - 1 and skip leading spaces; a value whose bytes overflow size_t
  // would wrap (2^44 MiB to 0, the cache silently off).
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(mb, &end, 10);
  if (*mb < '0' || *mb > '9' || *end != '\0' || errno == ERANGE || v > (SIZE_MAX >> 20)) {
    logger().warn("HALFGRAD_CPU_CACHE_MB: expected a number of MiB up to {}, got \"{}\"; the CPU cache keeps its 1 GiB "
                  "limit", SIZE_MAX >> 20, mb);
    return kDefaultLimit;
  }
  return size_t(v) << 20;
}

// 64-byte alignment: a cache line, and the width of an AVX-512 vector.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device) override {
    if (nbytes == 0) return nullptr;
    // No object may be larger (pointer differences must fit), and size_class's rounding up must not wrap.
    if (nbytes > size_t(PTRDIFF_MAX)) HG_FAIL("cpu allocator: out of memory allocating {} bytes", nbytes);
    const size_t size = size_class(nbytes);
    if (size >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = cache_.find(size);
      if (it != cache_.end()) {
        void* p = it->second;
        cache_.erase(it);
        cached_ -= size;
        return p;
      }
    }
    void* p = std::aligned_alloc(64, size);
    if (p == nullptr) {
      empty();
      p = std::aligned_alloc(64, size);
    }
    if (!p) HG_FAIL("cpu allocator: out of memory allocating {} bytes", nbytes);
    return p;
  }

  void deallocate(void* ptr, size_t nbytes, Device) override {
    const size_t size = size_class(nbytes);
    if (ptr != nullptr && size >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + size <= limit()) {
        cache_.emplace(size, ptr);
        cached_ += size;
        return;
      }
    }
    std::free(ptr);
  }

  void set_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
    // Largest blocks first: the fewest frees to get under the limit.
    while (cached_ > limit_) {
      auto last = std::prev(cache_.end());
      cached_ -= last->first;
      std::free(last->second);
      cache_.erase(last);
    }
  }
  size_t get_limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit();
  }
  size_t cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }
  void empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, p] : cache_) std::free(p);
    cache_.clear();
    cached_ = 0;
  }

 private:
  size_t limit() {  // with mutex_ held
    if (limit_ == kUnset) limit_ = limit_from_environment();
    return limit_;
  }

  static constexpr size_t kUnset = ~size_t(0);
  std::mutex mutex_;
  std::multimap<size_t, void*> cache_;  // size class -> free block
  size_t cached_ = 0, limit_ = kUnset;
};

// Never destroyed: tensors that outlive main (statics) still free into it.
CpuAllocator& cpu_allocator() {
  static CpuAllocator* a = new CpuAllocator;
  return *a;
}
Allocator* allocators[kNumDeviceTypes] = {&cpu_allocator(), nullptr};
}  // namespace

void set_cpu_cache_limit(size_t bytes) { cpu_allocator().set_limit(bytes); }
size_t cpu_cache_limit() { return cpu_allocator().get_limit(); }
size_t cpu_cached_bytes() { return cpu_allocator().cached(); }
void empty_cpu_cache() { cpu_allocator().empty(); }

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
