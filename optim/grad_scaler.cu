// The loss scaler's kernels on CUDA: the fused unscale-and-check pass (all gradients of one dtype in a few
// launches) and the scale's update, both reading and writing the scaler's state on the device.
//
// The work is cut into chunks of up to kChunk elements; each block takes one chunk. The chunk list travels
// by value as the kernel's parameter (no host-to-device copy, no allocation), kMaxChunks per launch, so a
// ResNet-50 (161 gradients, 25.6M elements) needs about four launches.
#include <cuda_runtime.h>

#include "core/cuda.h"
#include "optim/grad_scaler.h"

namespace halfgrad::amp {
namespace {

constexpr int64_t kChunk = 65536;
constexpr int kMaxChunks = 192;  // 16 bytes each: 3 KB of kernel parameters, under the classic 4 KB limit

struct Chunk {
  void* data;
  int64_t count;
};
struct ChunkList {
  Chunk chunks[kMaxChunks];
};

template <typename T>
__global__ void unscale_and_check(ChunkList list, const float* scale, float* found_inf) {
  const Chunk c = list.chunks[blockIdx.x];
  T* data = static_cast<T*>(c.data);
  const float inv = 1.0f / *scale;
  bool bad = false;
  for (int64_t i = threadIdx.x; i < c.count; i += blockDim.x) {
    opmath_t<T> v = opmath_t<T>(data[i]) * opmath_t<T>(inv);
    bad |= !isfinite(v);
    data[i] = T(v);
  }
  // Every thread that saw an inf/NaN writes the same value: no atomics needed.
  if (bad) *found_inf = 1.0f;
}

void unscale_cuda(const TensorList& grads, const Tensor& scale, const Tensor& found_inf) {
  if (grads.empty()) return;
  const Device device = grads[0].device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  dispatch_floating(grads[0].dtype(), "unscale_", [&]<typename T>() {
    ChunkList list;
    int n = 0;
    auto launch = [&] {
      unscale_and_check<T><<<n, 256, 0, stream>>>(list, scale.data<float>(), found_inf.data<float>());
      HG_CUDA_CHECK_LAUNCH("unscale_");
      n = 0;
    };
    for (const Tensor& g : grads) {
      HG_CHECK(g.is_contiguous() && g.dtype() == grads[0].dtype() && g.device() == device,
               "unscale_: gradients must be contiguous and share dtype and device, got {}", g.meta());
      g.storage()->bump_version();
      for (int64_t start = 0; start < g.numel(); start += kChunk) {
        list.chunks[n++] = {static_cast<T*>(g.data_ptr()) + start, std::min(kChunk, g.numel() - start)};
        if (n == kMaxChunks) launch();
      }
    }
    if (n > 0) launch();
  });
}

// One thread: the same arithmetic as update_scale_cpu (grad_scaler.cpp).
__global__ void update_scale(float* scale, int32_t* tracker, int64_t* skipped, const float* found_inf, float growth,
                             float backoff, int64_t interval, bool dynamic) {
  if (*found_inf != 0) {
    ++*skipped;
    if (dynamic) {
      *scale *= backoff;
      *tracker = 0;
    }
  } else if (dynamic && ++*tracker == interval) {
    const float grown = *scale * growth;
    if (isfinite(grown)) *scale = grown;
    *tracker = 0;
  }
}

void update_scale_cuda(const UpdateScaleArgs& a) {
  cuda::DeviceGuard guard(a.scale.device());
  update_scale<<<1, 1, 0, cuda::current_stream(a.scale.device())>>>(
      a.scale.data<float>(), a.growth_tracker.data<int32_t>(), a.skipped.data<int64_t>(), a.found_inf.data<float>(),
      float(a.growth_factor), float(a.backoff_factor), a.growth_interval, a.dynamic);
  HG_CUDA_CHECK_LAUNCH("update_scale");
  for (const Tensor* t : {&a.scale, &a.growth_tracker, &a.skipped}) t->storage()->bump_version();
}

}  // namespace

HG_REGISTER_KERNEL(unscale_kernel, CUDA, unscale_cuda);
HG_REGISTER_KERNEL(update_scale_kernel, CUDA, update_scale_cuda);

}  // namespace halfgrad::amp
