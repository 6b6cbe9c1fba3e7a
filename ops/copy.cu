// Copies on CUDA: the dtype-converting strided copy (copy_kernel), copies between the host and a GPU or between GPUs
// (transfer_kernel), and many copies in one launch (copy_each_kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "ops/copy.h"
#include "ops/copy_matrix.cuh"
#include "ops/cuda_loops.cuh"
#include "ops/elementwise_math.h"
#include "ops/multi_tensor.cuh"

namespace halfgrad {
namespace {

// ---- copy_kernel: dst[i] = convert(src[i]), both on one GPU, src viewed to dst's shape

// The conversion rule shared with the CPU kernel (convert_value, ops/elementwise_math.h).
template <typename To, typename From> struct ConvertFn {
  __device__ To operator()(From x) const { return convert_value<To>(x); }
};

void copy_cuda(const Tensor& dst, const Tensor& src) {
  HG_CHECK(dst.is_cuda() && src.device() == dst.device(), "copy: CUDA kernel given {} -> {}", src.meta(), dst.meta());
  if (dst.numel() == 0) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    cuda::DeviceGuard guard(dst.device());
    HG_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), size_t(dst.numel()) * element_size(dst.dtype()),
                                  cudaMemcpyDeviceToDevice, cuda::current_stream(dst.device())),
                  "copy");
    return;
  }
  if (dst.dtype() == src.dtype() && dst.dim() == 2 && src.dim() == 2 && dst.stride(1) == 1 && src.stride(1) == 1 &&
      src.size(0) == dst.size(0) && src.size(1) == dst.size(1)) {
    // Rows of a matrix into rows of another (a column range of a wider matrix taken out or put in): the matrix
    // copy's warps each move one coalesced run of a row (ops/copy_matrix.cuh), where the strided loop computes
    // every element's offsets (2.5 TB/s on the H200 for a recurrent layer's 6.8 MB weight-gradient halves).
    cuda::DeviceGuard guard(dst.device());
    const int64_t rows = dst.size(0), cols = dst.size(1);
    copy_matrix(element_size(dst.dtype()), dst.data_ptr(), rows, cols, dst.stride(0),
                {src.data_ptr(), rows, cols, src.stride(0)}, cuda::current_stream(dst.device()), "copy");
    return;
  }
  dispatch_all(dst.dtype(), "copy", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy", [&]<typename From>() {
      cuda::launch_elementwise<To, From>("copy", dst, ConvertFn<To, From>{}, {src});
    });
  });
}

// ---- transfer_kernel: contiguous, same dtype and shape, between the host and a GPU or two GPUs

// Page-locked host buffers that host<->device copies stage through. The DMA engines read and write only
// page-locked memory: a copy from ordinary (pageable) memory is asynchronous only through such a buffer.
// A buffer goes back to the pool with an event recorded after the copy that uses it; it is handed out
// again once that event has completed.
class PinnedPool {
 public:
  static constexpr size_t kChunk = size_t(16) << 20;    // larger transfers go in pieces of this size
  static constexpr size_t kMinBuffer = size_t(64) << 10;
  static constexpr size_t kMaxBuffers = 8;              // beyond this, wait for a buffer instead of allocating

  struct Buffer {
    void* ptr = nullptr;
    size_t size = 0;
    cudaEvent_t event = nullptr;  // recorded after the last copy that used the buffer
    int event_device = -1;
  };

  // A buffer of at least `size` bytes that no queued copy still uses.
  Buffer* acquire(size_t size) {
    std::unique_lock<std::mutex> lock(mutex_);
    Buffer* pick = nullptr;  // the smallest idle buffer that fits
    Buffer* busy = nullptr;  // else the smallest busy one that fits
    for (Buffer* b : free_) {
      if (b->size < size) continue;
      if (idle(b)) {
        if (!pick || b->size < pick->size) pick = b;
      } else if (!busy || b->size < busy->size) {
        busy = b;
      }
    }
    if (!pick && busy && count_ >= kMaxBuffers) {
      cuda::detail::count_host_synchronization();
      HG_CUDA_CHECK(cudaEventSynchronize(busy->event), "pinned staging buffer");
      pick = busy;
    }
    if (!pick && count_ >= kMaxBuffers && !free_.empty()) {
      // Every buffer is too small: replace one.
      Buffer* old = free_.front();
      cuda::detail::count_host_synchronization();
      if (old->event) HG_CUDA_CHECK(cudaEventSynchronize(old->event), "pinned staging buffer");
      remove(old);
      destroy(old);
    }
    if (pick) {
      remove(pick);
      return pick;
    }
    auto* b = new Buffer;
    b->size = std::max(kMinBuffer, std::bit_ceil(size));
    HG_CUDA_CHECK(cudaHostAlloc(&b->ptr, b->size, cudaHostAllocPortable), "pinned staging buffer");
    ++count_;
    return b;
  }

  // Records, on `stream` of `device` (the current device), that the copies queued so far use `b`.
  void record(Buffer* b, int device, cudaStream_t stream) {
    if (b->event_device != device) {
      if (b->event) HG_CUDA_CHECK(cudaEventDestroy(b->event), "pinned staging buffer");
      HG_CUDA_CHECK(cudaEventCreateWithFlags(&b->event, cudaEventDisableTiming), "pinned staging buffer");
      b->event_device = device;
    }
    HG_CUDA_CHECK(cudaEventRecord(b->event, stream), "pinned staging buffer");
  }

  void give_back(Buffer* b) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(b);
  }

 private:
  static bool idle(Buffer* b) {
    if (!b->event) return true;
    cudaError_t err = cudaEventQuery(b->event);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is an answer, not an error: don't leave it for the next check
      return false;
    }
    HG_CUDA_CHECK(err, "pinned staging buffer");
    return true;
  }
  void remove(Buffer* b) { free_.erase(std::find(free_.begin(), free_.end(), b)); }
  void destroy(Buffer* b) {
    if (b->event) HG_CUDA_CHECK(cudaEventDestroy(b->event), "pinned staging buffer");
    HG_CUDA_CHECK(cudaFreeHost(b->ptr), "pinned staging buffer");
    delete b;
    --count_;
  }

  std::mutex mutex_;
  std::vector<Buffer*> free_;
  size_t count_ = 0;  // buffers in existence, handed out or not
};

PinnedPool& pinned_pool() {
  static auto* pool = new PinnedPool;  // never destroyed: freeing pinned memory at exit races the driver
  return *pool;
}

// Host -> device: each piece is copied into a pinned buffer, then DMA'd asynchronously on the current
// stream. The host returns once everything is queued; the source may be modified right away.
void host_to_device(char* dst, const char* src, size_t nbytes, int device) {
  cuda::DeviceGuard guard(device);
  // A captured copy would replay from the staging buffer, which later copies reuse.
  HG_CHECK(!cuda::is_capturing(device), "to(cuda): a copy from the host ({} bytes) inside a CUDA graph capture; make "
           "the tensor on the device before capturing, or fill it with a device op", nbytes);
  cudaStream_t stream = cuda::current_stream(device);
  PinnedPool& pool = pinned_pool();
  for (size_t off = 0; off < nbytes; off += PinnedPool::kChunk) {
    size_t len = std::min(PinnedPool::kChunk, nbytes - off);
    PinnedPool::Buffer* b = pool.acquire(len);
    std::memcpy(b->ptr, src + off, len);
    HG_CUDA_CHECK(cudaMemcpyAsync(dst + off, b->ptr, len, cudaMemcpyHostToDevice, stream), "to(cuda)");
    pool.record(b, device, stream);
    pool.give_back(b);
  }
}

// Device -> host: pieces are DMA'd into pinned buffers on the current stream; the host waits for each
// (and so for all work queued before it on the stream) before it copies the piece out. Piece i+1's DMA
// overlaps the host's copy of piece i.
void device_to_host(char* dst, const char* src, size_t nbytes, int device) {
  cuda::DeviceGuard guard(device);
  HG_CHECK(!cuda::is_capturing(device), "to(cpu): a copy to the host ({} bytes, e.g. item()) inside a CUDA graph "
           "capture, where nothing has run yet", nbytes);
  cudaStream_t stream = cuda::current_stream(device);
  PinnedPool& pool = pinned_pool();
  PinnedPool::Buffer* pending = nullptr;
  size_t pending_off = 0, pending_len = 0;
  auto finish_pending = [&] {
    cuda::detail::count_host_synchronization();
    HG_CUDA_CHECK(cudaEventSynchronize(pending->event), "to(cpu)");
    std::memcpy(dst + pending_off, pending->ptr, pending_len);
    pool.give_back(pending);
    pending = nullptr;
  };
  for (size_t off = 0; off < nbytes; off += PinnedPool::kChunk) {
    size_t len = std::min(PinnedPool::kChunk, nbytes - off);
    PinnedPool::Buffer* b = pool.acquire(len);
    HG_CUDA_CHECK(cudaMemcpyAsync(b->ptr, src + off, len, cudaMemcpyDeviceToHost, stream), "to(cpu)");
    pool.record(b, device, stream);
    if (pending) finish_pending();
    pending = b;
    pending_off = off;
    pending_len = len;
  }
  if (pending) finish_pending();
}

// GPU -> GPU. The copy runs on the destination's current stream after the source's current stream has
// produced the data; the source's stream then waits for the copy, so the source memory is not reused
// (by the caching allocator, on that stream) while the copy still reads it.
void device_to_device(char* dst, int dst_device, const char* src, int src_device, size_t nbytes) {
  cudaStream_t src_stream = cuda::current_stream(src_device);
  cudaStream_t dst_stream = cuda::current_stream(dst_device);
  if (src_device == dst_device) {
    cuda::DeviceGuard guard(dst_device);
    HG_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, dst_stream), "to(cuda)");
    return;
  }
  cudaEvent_t source_ready = nullptr, copy_done = nullptr;
  {
    cuda::DeviceGuard guard(src_device);
    HG_CUDA_CHECK(cudaEventCreateWithFlags(&source_ready, cudaEventDisableTiming), "to(cuda)");
    HG_CUDA_CHECK(cudaEventRecord(source_ready, src_stream), "to(cuda)");
  }
  {
    cuda::DeviceGuard guard(dst_device);
    HG_CUDA_CHECK(cudaStreamWaitEvent(dst_stream, source_ready, 0), "to(cuda)");
    HG_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, dst_stream), "to(cuda)");
    HG_CUDA_CHECK(cudaEventCreateWithFlags(&copy_done, cudaEventDisableTiming), "to(cuda)");
    HG_CUDA_CHECK(cudaEventRecord(copy_done, dst_stream), "to(cuda)");
  }
  {
    cuda::DeviceGuard guard(src_device);
    HG_CUDA_CHECK(cudaStreamWaitEvent(src_stream, copy_done, 0), "to(cuda)");
  }
  // Destroying an event that is still pending is allowed: its resources go when it completes.
  HG_CUDA_CHECK(cudaEventDestroy(source_ready), "to(cuda)");
  HG_CUDA_CHECK(cudaEventDestroy(copy_done), "to(cuda)");
}

void transfer_cuda(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0 && src.numel() == 0) return;  // (an empty tensor need not count as contiguous)
  HG_CHECK(dst.dtype() == src.dtype() && dst.shape() == src.shape() && dst.is_contiguous() && src.is_contiguous(),
           "transfer: expected contiguous tensors of one dtype and shape, got {} -> {}", src.meta(), dst.meta());
  const size_t nbytes = size_t(dst.numel()) * element_size(dst.dtype());
  if (nbytes == 0) return;
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  if (src.is_cpu() && dst.is_cuda()) {
    host_to_device(d, s, nbytes, dst.device().index);
  } else if (src.is_cuda() && dst.is_cpu()) {
    device_to_host(d, s, nbytes, src.device().index);
  } else if (src.is_cuda() && dst.is_cuda()) {
    device_to_device(d, dst.device().index, s, src.device().index, nbytes);
  } else {
    HG_FAIL("transfer: CUDA backend given {} -> {}", src.meta(), dst.meta());
  }
}

// ---- copy_each_kernel: 1-D pairs of one dtype or a cast, a launch per batch of them (ops/multi_tensor.cuh)

// Operand 0 the source, 1 the destination; the elements move as unsigned integers of their size, so every bit pattern
// (a NaN's payload, -0) arrives as it left.
struct CopyEachOp {
  static constexpr bool writes(int operand) { return operand == 1; }
  template <typename M> __device__ void operator()(M (&r)[2], const multi_tensor::NoExtra&) const { r[1] = r[0]; }
};

// Pairs of two dtypes (float32 and float16 or bfloat16): each thread converts kVec elements at a time where both
// operands' chunks are aligned for it, as copy_kernel converts them (convert_value).
template <typename To, typename From>
__global__ void __launch_bounds__(multi_tensor::kBlock)
    cast_each_kernel(const HG_GRID_CONSTANT multi_tensor::TensorBatch<2, multi_tensor::NoExtra> batch) {
  using multi_tensor::kChunk;
  using multi_tensor::kVec;
  using multi_tensor::Vec;
  for (int64_t chunk = blockIdx.x; chunk < batch.num_chunks; chunk += gridDim.x) {
    const auto& e = multi_tensor::entry_of_chunk(batch, chunk);
    const int64_t begin = (chunk - e.first_chunk) * kChunk;
    const int64_t n = min(kChunk, e.numel - begin);
    const From* from = static_cast<const From*>(e.ptr[0]) + begin;
    To* to = static_cast<To*>(e.ptr[1]) + begin;
    int64_t done = 0;
    if (reinterpret_cast<uintptr_t>(from) % sizeof(Vec<From, kVec>) == 0 &&
        reinterpret_cast<uintptr_t>(to) % sizeof(Vec<To, kVec>) == 0) {
      const int64_t vectors = n / kVec;
      for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
        const Vec<From, kVec> x = reinterpret_cast<const Vec<From, kVec>*>(from)[v];
        Vec<To, kVec> y;
#pragma unroll
        for (int k = 0; k < kVec; ++k) y.v[k] = convert_value<To>(x.v[k]);
        reinterpret_cast<Vec<To, kVec>*>(to)[v] = y;
      }
      done = vectors * kVec;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) to[i] = convert_value<To>(from[i]);
  }
}

template <typename To, typename From> void launch_cast_each(const TensorList& dst, const TensorList& src) {
  const Device device = dst[0].device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  multi_tensor::for_each_batch<2, multi_tensor::NoExtra>(
      {&src, &dst}, [](size_t) { return multi_tensor::NoExtra{}; },
      [&](const multi_tensor::TensorBatch<2, multi_tensor::NoExtra>& batch) {
        cast_each_kernel<To, From><<<unsigned(batch.num_chunks), multi_tensor::kBlock, 0, stream>>>(batch);
        HG_CUDA_CHECK_LAUNCH("copy_each_");
      });
}

void copy_each_cuda(const TensorList& dst, const TensorList& src) {
  const DType to = dst[0].dtype(), from = src[0].dtype();
  if (to != from) {
    HG_CHECK(copy_each_kernel_takes(to, from), "copy_each_: the CUDA kernel converts float32 from and to float16 "
             "and bfloat16, not {} -> {}", src[0].meta(), dst[0].meta());
    if (to == kFloat32) {
      return from == kFloat16 ? launch_cast_each<float, Half>(dst, src) : launch_cast_each<float, BFloat16>(dst, src);
    }
    return to == kFloat16 ? launch_cast_each<Half, float>(dst, src) : launch_cast_each<BFloat16, float>(dst, src);
  }
  auto launch = [&]<typename Bits>() {
    multi_tensor::launch_multi_tensor<Bits, 2, multi_tensor::NoExtra>(
        "copy_each_", dst[0].device(), {&src, &dst}, [](size_t) { return multi_tensor::NoExtra{}; }, CopyEachOp{});
  };
  switch (element_size(dst[0].dtype())) {
    case 1: return launch.template operator()<uint8_t>();
    case 2: return launch.template operator()<uint16_t>();
    case 4: return launch.template operator()<uint32_t>();
    case 8: return launch.template operator()<uint64_t>();
    default: HG_FAIL("copy_each_: no copy for elements of {} bytes ({})", element_size(dst[0].dtype()), dst[0].meta());
  }
}

}  // namespace

HG_REGISTER_KERNEL(copy_kernel, CUDA, copy_cuda);
HG_REGISTER_KERNEL(transfer_kernel, CUDA, transfer_cuda);
HG_REGISTER_KERNEL(copy_each_kernel, CUDA, copy_each_cuda);

}  // namespace halfgrad
