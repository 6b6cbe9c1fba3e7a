// The CUDA caching allocator (core/cuda_allocator.h). Compiled in every build; without CUDA the statistics
// functions report zeros and nothing is registered.
#include "core/cuda_allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/log.h"
#include "core/storage.h"

#if HALFGRAD_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace halfgrad::cuda {

std::string format_bytes(size_t bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

#if HALFGRAD_WITH_CUDA

namespace {

constexpr size_t kMinBlockSize = 512;               // every size is rounded up to this
constexpr size_t kSmallRequest = size_t(1) << 20;   // requests up to 1 MiB use the small pool
constexpr size_t kSmallSegment = size_t(2) << 20;   // the small pool's cudaMalloc size
constexpr size_t kLargeSegment = size_t(20) << 20;  // large pool segment for requests under 10 MiB
constexpr size_t kMinLargeAlloc = size_t(10) << 20;
constexpr size_t kRoundLarge = size_t(2) << 20;     // larger requests are rounded up to this
constexpr size_t kMaxRequest = size_t(1) << 62;     // beyond this a request is refused outright

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// HALFGRAD_CUDA_NO_CACHING: unset, empty, 0, false, no or off leave caching on; any other value turns it off.
std::atomic<bool>& caching_flag() {
  static std::atomic<bool> flag{[] {
    const char* v = std::getenv("HALFGRAD_CUDA_NO_CACHING");
    std::string value = v ? v : "";
    std::transform(value.begin(), value.end(), value.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
    return value.empty() || value == "0" || value == "false" || value == "no" || value == "off";
  }()};
  return flag;
}

struct Block {
  size_t size = 0;       // size of this block (rounded up to kMinBlockSize while caching is on)
  size_t requested = 0;  // what the owner asked for (while allocated)
  char* ptr = nullptr;
  cudaStream_t stream = nullptr;
  bool small = false;     // which pool
  bool allocated = false;
  Block* prev = nullptr;  // neighbours inside the same cudaMalloc segment
  Block* next = nullptr;
};

// Free blocks ordered by (stream, size, address): lower_bound finds the smallest fitting block of a stream.
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return std::less<cudaStream_t>()(a->stream, b->stream);
    if (a->size != b->size) return a->size < b->size;
    return std::less<char*>()(a->ptr, b->ptr);
  }
};
using FreeBlocks = std::set<Block*, BlockOrder>;

class DeviceCache {
 public:
  explicit DeviceCache(int device) : device_(device) {}

  void* allocate(size_t nbytes) {
    if (nbytes > kMaxRequest) {  // rounding would wrap around; no device has this much anyway
      std::lock_guard<std::mutex> lock(mutex_);
      throw_out_of_memory(nbytes, nbytes);
    }
    const bool cached = caching();
    const size_t size = cached ? round_up(nbytes, kMinBlockSize) : nbytes;
    const bool small = size <= kSmallRequest;
    DeviceGuard guard(device_);
    cudaStream_t stream = current_stream(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    FreeBlocks& pool = small ? small_free_ : large_free_;

    Block* block = cached ? take_free(pool, stream, size) : nullptr;
    if (!block) block = new_segment(cached ? segment_size(size, small) : size, nbytes, small, stream);
    if (cached) split(block, size, pool);

    block->allocated = true;
    block->requested = nbytes;
    active_.emplace(block->ptr, block);
    stats_.allocated_bytes += block->size;
    stats_.requested_bytes += nbytes;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    stats_.num_allocations++;
    return block->ptr;
  }

  void deallocate(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = active_.find(ptr);
    if (it == active_.end()) return;  // not ours: nothing sensible to do in a destructor path
    Block* block = it->second;
    active_.erase(it);
    block->allocated = false;
    stats_.allocated_bytes -= block->size;
    stats_.requested_bytes -= block->requested;
    block->requested = 0;
    FreeBlocks& pool = block->small ? small_free_ : large_free_;
    // Merge with free neighbours so that the segment can be handed out whole again.
    for (Block* neighbour : {block->prev, block->next}) {
      if (!neighbour || neighbour->allocated) continue;
      pool.erase(neighbour);
      if (neighbour == block->prev) {
        neighbour->size += block->size;
        neighbour->next = block->next;
        if (block->next) block->next->prev = neighbour;
        delete block;
        block = neighbour;
      } else {
        block->size += neighbour->size;
        block->next = neighbour->next;
        if (neighbour->next) neighbour->next->prev = block;
        delete neighbour;
      }
    }
    // Caching off: a segment that is whole again goes back to the driver at once, unless a CUDA graph's replays write
    // it (its stream is held).
    if (!caching() && !block->prev && !block->next && !held_.count(block->stream)) {
      DeviceGuard guard(device_);
      // From a tensor's destructor: an error (a sticky one left by a faulty kernel) is logged, never thrown.
      if (const cudaError_t err = cudaFree(block->ptr); err != cudaSuccess) {
        (void)cudaGetLastError();
        logger().error("cuda allocator: cudaFree of a {} segment on cuda:{} failed: {}", format_bytes(block->size),
                       device_, cudaGetErrorString(err));
      }
      stats_.num_cuda_frees++;
      stats_.reserved_bytes -= block->size;
      delete block;
      return;
    }
    pool.insert(block);
  }

  void empty_cache() {
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached();
  }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

  void set_limit(size_t bytes) {
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes != 0 && stats_.reserved_bytes > bytes) release_cached();
    HG_CHECK(bytes == 0 || stats_.reserved_bytes <= bytes,
             "cuda::set_memory_limit: cuda:{} has {} reserved in tensors that are alive, more than the limit of {}",
             device_, format_bytes(stats_.reserved_bytes), format_bytes(bytes));
    limit_ = bytes;
  }

  size_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  void hold(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_.insert(stream);
  }

  void release(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_.erase(stream);
    for (FreeBlocks* pool : {&small_free_, &large_free_}) {
      std::vector<Block*> moved;
      for (auto it = pool->begin(); it != pool->end();) {
        if ((*it)->stream == stream) {
          moved.push_back(*it);
          it = pool->erase(it);
        } else {
          ++it;
        }
      }
      for (Block* b : moved) {
        b->stream = nullptr;
        pool->insert(b);
      }
    }
  }

 private:
  // The smallest free block of `pool` on `stream` that holds `size` bytes, removed from the pool.
  Block* take_free(FreeBlocks& pool, cudaStream_t stream, size_t size) {
    Block key;
    key.stream = stream;
    key.size = size;
    key.ptr = nullptr;
    auto it = pool.lower_bound(&key);
    if (it == pool.end() || (*it)->stream != stream) return nullptr;
    Block* block = *it;
    pool.erase(it);
    return block;
  }

  // Splits off the unused tail of `block` as a free block when it is worth keeping.
  void split(Block* block, size_t size, FreeBlocks& pool) {
    size_t rest = block->size - size;
    bool worth = block->small ? rest >= kMinBlockSize : rest > kSmallRequest;
    if (!worth) return;
    auto* tail = new Block;
    tail->size = rest;
    tail->ptr = block->ptr + size;
    tail->stream = block->stream;
    tail->small = block->small;
    tail->prev = block;
    tail->next = block->next;
    if (block->next) block->next->prev = tail;
    block->next = tail;
    block->size = size;
    pool.insert(tail);
  }

  static size_t segment_size(size_t size, bool small) {
    return small ? kSmallSegment : size < kMinLargeAlloc ? kLargeSegment : round_up(size, kRoundLarge);
  }

  Block* new_segment(size_t segment, size_t requested, bool small, cudaStream_t stream) {
    void* ptr = nullptr;
    auto over_limit = [&] { return limit_ != 0 && stats_.reserved_bytes + segment > limit_; };
    cudaError_t err = over_limit() ? cudaErrorMemoryAllocation : cudaMalloc(&ptr, segment);
    if (is_out_of_memory(err, segment)) {
      (void)cudaGetLastError();  // clear it: an out-of-memory is not sticky
      stats_.num_oom_retries++;
      release_cached();
      err = over_limit() ? cudaErrorMemoryAllocation : cudaMalloc(&ptr, segment);
      if (is_out_of_memory(err, segment)) {
        (void)cudaGetLastError();
        throw_out_of_memory(requested, segment);
      }
    }
    HG_CUDA_CHECK(err, "cuda caching allocator");
    stats_.num_cuda_mallocs++;
    stats_.reserved_bytes += segment;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    auto* block = new Block;
    block->size = segment;
    block->ptr = static_cast<char*>(ptr);
    block->stream = stream;
    block->small = small;
    return block;
  }

  // cudaMalloc reports a request beyond the device's memory as cudaErrorMemoryAllocation; some drivers
  // answer an absurd size with cudaErrorInvalidValue instead, which is the same condition for the caller.
  static bool is_out_of_memory(cudaError_t err, size_t segment) {
    if (err == cudaErrorMemoryAllocation) return true;
    if (err != cudaErrorInvalidValue) return false;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return false;
    return segment > total_bytes;
  }

  // cudaFree on every cached block that is a whole segment (cudaFree waits for the device to be idle, so
  // no kernel still reads a block being freed).
  void release_cached() {
    for (FreeBlocks* pool : {&small_free_, &large_free_}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* b = *it;
        if (b->prev || b->next || held_.count(b->stream)) {
          ++it;
          continue;
        }
        HG_CUDA_CHECK(cudaFree(b->ptr), "cuda caching allocator");
        stats_.num_cuda_frees++;
        stats_.reserved_bytes -= b->size;
        it = pool->erase(it);
        delete b;
      }
    }
  }

  [[noreturn]] void throw_out_of_memory(size_t requested, size_t segment) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    const std::string limit =
        limit_ == 0 ? "" : fmt::format(" The memory limit is {} (cuda::set_memory_limit).", format_bytes(limit_));
    throw OutOfMemory(fmt::format(
        "CUDA out of memory on cuda:{}: tried to allocate {} ({} bytes; a segment of {}). The device has {} "
        "free of {}.{} Caching allocator: {}. Free tensors you no longer need or use a smaller batch.",
        device_, format_bytes(requested), requested, format_bytes(segment), format_bytes(free_bytes),
        format_bytes(total_bytes), limit, stats_line(stats_)));
  }

 public:
  static std::string stats_line(const MemoryStats& s) {
    return fmt::format("allocated {}, reserved {} (cached {}), peak allocated {}, {} cudaMalloc calls, {} cudaFree "
                       "calls, {} allocations",
                       format_bytes(s.allocated_bytes), format_bytes(s.reserved_bytes),
                       format_bytes(s.reserved_bytes - s.allocated_bytes), format_bytes(s.peak_allocated_bytes),
                       s.num_cuda_mallocs, s.num_cuda_frees, s.num_allocations);
  }

 private:
  const int device_;
  std::mutex mutex_;
  FreeBlocks small_free_, large_free_;
  std::set<cudaStream_t> held_;  // streams of live CUDA graphs
  std::unordered_map<void*, Block*> active_;
  MemoryStats stats_;
  size_t limit_ = 0;  // 0: none
};

class CachingAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device device) override {
    if (nbytes == 0) return nullptr;
    return cache(device.index, "allocate").allocate(nbytes);
  }
  void deallocate(void* ptr, size_t, Device device) override {
    if (ptr) cache(device.index, "deallocate").deallocate(ptr);
  }

  // The cache of `device`. The caches are created on first use: the allocator's first CUDA call.
  DeviceCache& cache(int device, const char* what) {
    init();
    HG_CHECK(!caches_.empty(), "cuda allocator ({}): no CUDA device is available (no GPU or no driver)", what);
    HG_CHECK(device >= 0 && device < int(caches_.size()), "cuda allocator ({}): CUDA device {} does not exist ({} "
             "visible)", what, device, caches_.size());
    return *caches_[size_t(device)];
  }
  bool has(int device) {
    init();
    return device >= 0 && device < int(caches_.size());
  }
  int size() {
    init();
    return int(caches_.size());
  }

 private:
  void init() {
    std::call_once(init_, [this] {
      for (int d = 0; d < device_count(); ++d) caches_.push_back(std::make_unique<DeviceCache>(d));
    });
  }

  std::once_flag init_;
  std::vector<std::unique_ptr<DeviceCache>> caches_;
};

// Never destroyed: tensors freed during static destruction still find it, and cudaFree at exit would
// race the driver's own teardown.
CachingAllocator& caching_allocator() {
  static auto* instance = new CachingAllocator;
  return *instance;
}

// Registration makes no CUDA call, so it is safe on a machine without a driver.
const bool registered = [] {
  set_allocator(DeviceType::CUDA, &caching_allocator());
  return true;
}();

int resolve(int device) { return device < 0 ? (is_available() ? current_device() : 0) : device; }

}  // namespace

MemoryStats memory_stats(int device) {
  device = resolve(device);
  if (!caching_allocator().has(device)) return {};
  return caching_allocator().cache(device, "memory_stats").stats();
}

void reset_peak(int device) {
  device = resolve(device);
  if (caching_allocator().has(device)) caching_allocator().cache(device, "reset_peak").reset_peak();
}

size_t device_memory(int device) {
  device = resolve(device);
  DeviceGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  HG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes), "cuda::device_memory");
  return total_bytes;
}

void set_memory_limit(size_t bytes, int device) {
  device = resolve(device);
  const size_t total = device_memory(device);
  HG_CHECK(bytes <= total, "cuda::set_memory_limit: a limit of {} is more than cuda:{} has ({})", format_bytes(bytes),
           device, format_bytes(total));
  caching_allocator().cache(device, "set_memory_limit").set_limit(bytes);
}

size_t memory_limit(int device) {
  device = resolve(device);
  return caching_allocator().has(device) ? caching_allocator().cache(device, "memory_limit").limit() : 0;
}

bool caching() { return caching_flag().load(); }

void set_caching(bool enabled) {
  caching_flag().store(enabled);
  if (!enabled) empty_cache();
}

void empty_cache() {
  int n = caching_allocator().size();
  for (int d = 0; d < n; ++d) caching_allocator().cache(d, "empty_cache").empty_cache();
}

void hold_stream_blocks(int device, cudaStream_t stream) { caching_allocator().cache(device, "graph pool").hold(stream); }
void release_stream_blocks(int device, cudaStream_t stream) {
  caching_allocator().cache(device, "graph pool").release(stream);
}

std::string memory_stats_str(int device) { return DeviceCache::stats_line(memory_stats(device)); }

#else  // no CUDA in this build

MemoryStats memory_stats(int) { return {}; }
void reset_peak(int) {}
void set_memory_limit(size_t, int) { HG_FAIL("cuda::set_memory_limit: this build has no CUDA"); }
size_t memory_limit(int) { return 0; }
size_t device_memory(int) { HG_FAIL("cuda::device_memory: this build has no CUDA"); }
bool caching() { return true; }
void set_caching(bool) {}
void empty_cache() {}
void hold_stream_blocks(int, cudaStream_t) {}
void release_stream_blocks(int, cudaStream_t) {}
std::string memory_stats_str(int) { return "no CUDA in this build"; }

#endif

}  // namespace halfgrad::cuda
