// The loss scaler's kernels on CUDA: the fused unscale-and-check pass (all gradients of one dtype in a few
// launches of multi-tensor apply, ops/multi_tensor.cuh) and the scale's update, both reading and writing the
// scaler's state on the device.
#include <cuda_runtime.h>

#include "core/cuda.h"
#include "optim/grad_scaler.h"
#include "ops/multi_tensor.cuh"

namespace halfgrad::amp {
namespace {

// g *= 1 / scale, in opmath_t; a result that is not finite once stored as T sets found_inf (a scale below 1
// multiplies float16 gradients up: 30000 * 4 is finite in float32, inf in float16). Every thread that sees one writes
// the same value: no atomics needed.
template <typename T> struct UnscaleOp {
  const float* scale;
  float* found_inf;
  static constexpr __device__ bool writes(int) { return true; }
  template <typename M>
  __device__ __forceinline__ void operator()(M (&r)[1], const multi_tensor::NoExtra&) const {
    r[0] = r[0] * M(1.0f / __ldg(scale));
    if (!isfinite(M(T(r[0])))) *found_inf = 1.0f;
  }
};

void unscale_cuda(const TensorList& grads, const Tensor& scale, const Tensor& found_inf) {
  if (grads.empty()) return;
  const Device device = grads[0].device();
  for (const Tensor& g : grads) {
    HG_CHECK(g.is_contiguous() && g.dtype() == grads[0].dtype() && g.device() == device,
             "unscale_: gradients must be contiguous and share dtype and device, got {}", g.meta());
    g.storage()->bump_version();
  }
  dispatch_floating(grads[0].dtype(), "unscale_", [&]<typename T>() {
    multi_tensor::launch_multi_tensor<T, 1, multi_tensor::NoExtra>(
        "unscale_", device, {&grads}, [](size_t) { return multi_tensor::NoExtra{}; },
        UnscaleOp<T>{scale.data<float>(), found_inf.data<float>()});
  });
}

__global__ void update_scale(float* scale, int32_t* tracker, int64_t* skipped, const float* found_inf, float growth,
                             float backoff, float min_scale, float max_scale, int64_t interval, bool dynamic) {
  update_scale_rule(*scale, *tracker, *skipped, *found_inf != 0, growth, backoff, min_scale, max_scale, interval,
                    dynamic);
}

void update_scale_cuda(const UpdateScaleArgs& a) {
  cuda::DeviceGuard guard(a.scale.device());
  update_scale<<<1, 1, 0, cuda::current_stream(a.scale.device())>>>(
      a.scale.data<float>(), a.growth_tracker.data<int32_t>(), a.skipped.data<int64_t>(), a.found_inf.data<float>(),
      float(a.growth_factor), float(a.backoff_factor), float(a.min_scale), float(a.max_scale), a.growth_interval,
      a.dynamic);
  HG_CUDA_CHECK_LAUNCH("update_scale");
  for (const Tensor* t : {&a.scale, &a.growth_tracker, &a.skipped}) t->storage()->bump_version();
}

}  // namespace

HG_REGISTER_KERNEL(unscale_kernel, CUDA, unscale_cuda);
HG_REGISTER_KERNEL(update_scale_kernel, CUDA, update_scale_cuda);

}  // namespace halfgrad::amp
