#pragma once
// The CUDA caching allocator: device memory for every CUDA tensor (core/storage.h's Allocator for
// DeviceType::CUDA, registered at start-up; it makes no CUDA call until the first allocation).
//
// cudaMalloc and cudaFree are slow and synchronise the device, so freed blocks are kept and handed out
// again. Like PyTorch's allocator:
//   - sizes are rounded up to 512 bytes;
//   - requests up to 1 MiB come from a small pool carved out of 2 MiB segments; larger ones from a large
//     pool (a 20 MiB segment for requests under 10 MiB, else the request rounded up to 2 MiB);
//   - a cached block is reused for a request of its pool on the same stream (work on one stream runs in
//     order, so the new owner cannot overtake the old one's kernels), the smallest fitting block first,
//     split when the rest is worth keeping; freed neighbours in a segment merge again;
//   - when cudaMalloc fails, the cached blocks that are whole segments are released and the call retried
//     once; a second failure throws halfgrad::OutOfMemory with the size and these statistics;
//   - caching can be turned off (set_caching) for compute-sanitizer's memcheck;
//   - a memory limit (set_memory_limit, as torch.cuda.set_per_process_memory_fraction) caps what is reserved: a
//     segment that would pass it is an out-of-memory too, after the same release of the cache.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/cuda.h"  // cudaStream_t

namespace halfgrad::cuda {

struct MemoryStats {
  size_t allocated_bytes = 0;       // in blocks handed out now (rounded sizes)
  size_t reserved_bytes = 0;        // held from cudaMalloc: allocated plus cached
  size_t peak_allocated_bytes = 0;  // the most allocated_bytes has been since start or reset_peak()
  size_t peak_reserved_bytes = 0;   // the most reserved_bytes has been since start or reset_peak()
  size_t requested_bytes = 0;       // sizes as asked for, of the blocks handed out now
  uint64_t num_allocations = 0;     // allocations served (each tensor storage is one)
  uint64_t num_cuda_mallocs = 0;    // segments obtained from cudaMalloc
  uint64_t num_cuda_frees = 0;      // segments returned with cudaFree
  uint64_t num_oom_retries = 0;     // cudaMalloc failures that led to releasing the cache and retrying
};

// Statistics of one device (-1: the current device). All zero for a device not used yet.
MemoryStats memory_stats(int device = -1);
// Sets the peaks to the bytes allocated and reserved now.
void reset_peak(int device = -1);
// Caps the bytes the allocator may reserve on `device` (-1: the current one) from now on; 0 removes the cap. More than
// the device has is an error naming both sizes; less than is reserved now first releases the cache, and is an error
// if that is not enough. What `halfgrad bench max-batch --memory-budget` runs under.
void set_memory_limit(size_t bytes, int device = -1);
size_t memory_limit(int device = -1);  // 0: none
// The device's memory in bytes (cudaMemGetInfo's total).
size_t device_memory(int device = -1);
// Caching on (the default) or off. Off (also HALFGRAD_CUDA_NO_CACHING=1 in the environment, any value but 0, false, no,
// off or empty; as PyTorch's PYTORCH_NO_CUDA_MEMORY_CACHING): every allocation is a cudaMalloc of its exact size,
// returned with cudaFree when freed. Slow, but compute-sanitizer's memcheck then reports a kernel reading past a
// tensor's end, which inside a cached segment lands in another block and goes unseen. Turning it off empties the cache,
// and segments that become whole again go back to the driver as their last block is freed; cuda::Graph refuses to
// capture while it is off (a graph's replays write the blocks its capture was given, which must stay allocated and its
// own).
bool caching();
void set_caching(bool enabled);
// Returns every cached (free) whole segment of every device to the driver with cudaFree. Memory still in
// use stays; so do free blocks that share a segment with a block in use.
void empty_cache();
// For cuda::Graph (core/cuda_graph.h), whose replays write the blocks its capture was given: blocks are only ever
// reused on the stream they were made on, so those of a graph's private stream are its pool; while held, they are
// not returned to the driver either (empty_cache, the retry after an out-of-memory). Releasing hands the free ones
// to the legacy default stream (the caller makes sure the graph's work has finished).
void hold_stream_blocks(int device, cudaStream_t stream);
void release_stream_blocks(int device, cudaStream_t stream);
// The statistics as one line, as out-of-memory messages print them.
std::string memory_stats_str(int device = -1);
std::string format_bytes(size_t bytes);  // "1.50 GiB"

}  // namespace halfgrad::cuda
