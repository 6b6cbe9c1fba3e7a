// dropout on CUDA: the kernel behind dropout_kernel (ops/dropout.h). One thread per Philox counter, i.e.
// per 4 consecutive elements, so the mask is bit-identical to the CPU kernel's for the same state.
#include <cuda_runtime.h>

#include "core/cuda.h"
#include "ops/dropout.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dropout_kernel_cuda(T* out, const T* in, int64_t n, float keep, opmath_t<T> scale, GeneratorState state) {
  using A = opmath_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c * 4 >= n) return;
  const SeedAndOffset s = seed_and_offset(state);  // read on the device: a captured graph's replays draw anew
  const Philox::U4 r = Philox::generate(s.seed, s.offset + uint64_t(c));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t i = c * 4 + k;
    if (i < n) out[i] = T(A(in[i]) * dropout_factor(Philox::uniform(r.x[k]), keep, scale));
  }
}

void dropout_cuda(const Tensor& out, const Tensor& in, double p, GeneratorState state) {
  HG_CHECK(out.is_contiguous() && in.is_contiguous() && out.device() == in.device(),
           "dropout: dropout_cuda expects contiguous operands on one device, got {} and {}", out.meta(), in.meta());
  const int64_t n = in.numel();
  if (n == 0) return;
  const int64_t counters = (n + 3) / 4;
  cuda::DeviceGuard guard(in.device());
  cudaStream_t stream = cuda::current_stream(in.device());
  dispatch_floating(in.dtype(), "dropout", [&]<typename T>() {
    using A = opmath_t<T>;
    dropout_kernel_cuda<T><<<unsigned((counters + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        out.data<T>(), in.data<T>(), n, float(1.0 - p), A(1.0 / (1.0 - p)), state);
    HG_CUDA_CHECK_LAUNCH("dropout");
  });
}

}  // namespace

HG_REGISTER_KERNEL(dropout_kernel, CUDA, dropout_cuda);

}  // namespace halfgrad
