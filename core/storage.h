#pragma once
// Storage: one reference-counted block of device memory that tensors (and their views) share.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/device.h"

namespace halfgrad {

// A device's memory allocator. The CPU one is 64-byte aligned malloc with a cache of large freed blocks (below);
// the CUDA one is the caching allocator of the CUDA backend, which registers itself at start-up (see
// set_allocator).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes, Device device) = 0;
  virtual void deallocate(void* ptr, size_t nbytes, Device device) = 0;
};

Allocator* allocator_for(Device device);  // throws if the device type has no backend in this build
void set_allocator(DeviceType type, Allocator* allocator);

// ---- the CPU allocator's cache
// Freed CPU blocks of 1 MiB or more are kept, up to a limit, and handed to the next request of their size class
// (sizes rounded up by at most 1/8). malloc returns such blocks to the kernel at free and gets fresh mappings,
// which the kernel zero-fills page by page on first touch: a training loop that frees and reallocates the same
// ~90 MB temporaries every step spent a quarter of its time in page faults. Smaller blocks go back to malloc.
//
// The limit is 1 GiB, or HALFGRAD_CPU_CACHE_MB (0 turns the cache off) read at the first allocation, or
// set_cpu_cache_limit. A block that would take the cache over the limit is freed; an allocation that fails
// empties the cache and tries again.
void set_cpu_cache_limit(size_t bytes);  // frees cached blocks beyond the new limit
size_t cpu_cache_limit();
size_t cpu_cached_bytes();  // held in the cache now, free for reuse
void empty_cpu_cache();     // frees every cached block

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
  // How many in-place writes that autograd records have given a tensor of this storage a new history (counted by
  // rebase_history): views whose history is older are given one from their base's (TensorImpl::history_seen).
  uint64_t history_version() const { return history_version_; }
  void mark_history_written() { ++history_version_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  uint64_t version_ = 0;
  uint64_t history_version_ = 0;
};

}  // namespace halfgrad
