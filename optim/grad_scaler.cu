// The fused unscale-and-check pass on CUDA: all gradients of one dtype in a few launches.
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
__global__ void unscale_and_check(ChunkList list, const float* inv_scale, float* found_inf) {
  const Chunk c = list.chunks[blockIdx.x];
  T* data = static_cast<T*>(c.data);
  const float inv = *inv_scale;
  bool bad = false;
  for (int64_t i = threadIdx.x; i < c.count; i += blockDim.x) {
    opmath_t<T> v = opmath_t<T>(data[i]) * opmath_t<T>(inv);
    bad |= !isfinite(v);
    data[i] = T(v);
  }
  // Every thread that saw an inf/NaN writes the same value: no atomics needed.
  if (bad) *found_inf = 1.0f;
}

void unscale_cuda(const TensorList& grads, const Tensor& inv_scale, const Tensor& found_inf) {
  if (grads.empty()) return;
  const Device device = grads[0].device();
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::current_stream(device);
  dispatch_floating(grads[0].dtype(), "unscale_", [&]<typename T>() {
    ChunkList list;
    int n = 0;
    auto launch = [&] {
      unscale_and_check<T><<<n, 256, 0, stream>>>(list, inv_scale.data<float>(), found_inf.data<float>());
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

}  // namespace

HG_REGISTER_KERNEL(unscale_kernel, CUDA, unscale_cuda);

}  // namespace halfgrad::amp
