// Loss kernels on CUDA: nll_loss's gather (forward) and scatter (backward), behind nll_loss_kernel and
// nll_loss_backward_kernel, and cross_entropy's one-pass backward, cross_entropy_backward_kernel (ops/loss.h). The
// other losses are tensor-op compositions (ops/loss.cpp).
//
// One thread per target element. A target outside [0, C) that is not ignore_index stops the kernel with a
// device-side assertion after printing the target, its position and C (the CPU kernel throws instead; a
// host-side check would cost a device synchronisation on every call).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "core/cuda.h"
#include "ops/loss.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    nll_loss_kernel_cuda(opmath_t<T>* loss, opmath_t<T>* weights, const T* input, const int64_t* target,
                         const opmath_t<T>* weight, int64_t count, int64_t classes, int64_t inner,
                         int64_t ignore_index) {
  using A = opmath_t<T>;
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const int64_t c = target[k];
  if (c == ignore_index) {
    loss[k] = A(0);
    weights[k] = A(0);
    return;
  }
  if (c < 0 || c >= classes) {
    printf("nll_loss / cross_entropy: target %lld at position %lld is out of range for %lld classes\n",
           (long long)c, (long long)k, (long long)classes);
    __assert_fail("target in [0, classes) or ignore_index", __FILE__, __LINE__, __func__);
  }
  const int64_t n = k / inner, i = k % inner;
  const A wc = weight ? weight[c] : A(1);
  loss[k] = -wc * A(input[(n * classes + c) * inner + i]);
  weights[k] = wc;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    nll_loss_backward_kernel_cuda(T* grad_input, const opmath_t<T>* grad_loss, const int64_t* target,
                                  const opmath_t<T>* weight, int64_t count, int64_t classes, int64_t inner,
                                  int64_t ignore_index) {
  using A = opmath_t<T>;
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const int64_t c = target[k];
  if (c == ignore_index || c < 0 || c >= classes) return;  // (the forward has reported a bad target)
  const int64_t n = k / inner, i = k % inner;
  grad_input[(n * classes + c) * inner + i] = T(-(weight ? weight[c] : A(1)) * grad_loss[k]);
}

// One thread per element of the logits' gradient (grid-stride).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_backward_kernel_cuda(T* grad_input, const opmath_t<T>* grad_loss, const T* log_probs,
                                       const int64_t* target, const opmath_t<T>* weight, int64_t count,
                                       int64_t classes, int64_t inner, int64_t ignore_index) {
  using A = opmath_t<T>;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, j = (e / inner) % classes, n = e / (inner * classes), k = n * inner + i;
    const int64_t c = target[k];
    const A scale = c == ignore_index ? A(0) : grad_loss[k] * (weight ? weight[c] : A(1));
    grad_input[e] = T(scale * (exp(A(log_probs[e])) - (j == c ? A(1) : A(0))));
  }
}

unsigned blocks_for(int64_t count) { return unsigned((count + kThreads - 1) / kThreads); }

void nll_loss_cuda(const Tensor& loss, const Tensor& weights, const Tensor& input, const Tensor& target,
                   const Tensor& weight, int64_t ignore_index, const char* op) {
  const int64_t classes = input.size(1), inner = input.size(2), count = target.numel();
  if (count == 0) return;
  cuda::DeviceGuard guard(input.device());
  cudaStream_t stream = cuda::current_stream(input.device());
  dispatch_floating(input.dtype(), op, [&]<typename T>() {
    using A = opmath_t<T>;
    nll_loss_kernel_cuda<T><<<blocks_for(count), kThreads, 0, stream>>>(
        loss.data<A>(), weights.data<A>(), input.data<T>(), target.data<int64_t>(),
        weight.defined() ? weight.data<A>() : nullptr, count, classes, inner, ignore_index);
    HG_CUDA_CHECK_LAUNCH(op);
  });
}

void nll_loss_backward_cuda(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& target,
                            const Tensor& weight, int64_t ignore_index) {
  const int64_t classes = grad_input.size(1), inner = grad_input.size(2), count = target.numel();
  cuda::DeviceGuard guard(grad_input.device());
  cudaStream_t stream = cuda::current_stream(grad_input.device());
  // All-zero bytes are 0.0 in every floating dtype.
  HG_CUDA_CHECK(cudaMemsetAsync(grad_input.data_ptr(), 0, size_t(grad_input.numel()) * element_size(grad_input.dtype()),
                                stream), "nll_loss_backward");
  if (count == 0) return;
  dispatch_floating(grad_input.dtype(), "nll_loss_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    nll_loss_backward_kernel_cuda<T><<<blocks_for(count), kThreads, 0, stream>>>(
        grad_input.data<T>(), grad_loss.data<A>(), target.data<int64_t>(),
        weight.defined() ? weight.data<A>() : nullptr, count, classes, inner, ignore_index);
    HG_CUDA_CHECK_LAUNCH("nll_loss_backward");
  });
}

void cross_entropy_backward_cuda(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& log_probs,
                                 const Tensor& target, const Tensor& weight, int64_t ignore_index) {
  const int64_t classes = grad_input.size(1), inner = grad_input.size(2), count = grad_input.numel();
  if (count == 0) return;
  cuda::DeviceGuard guard(grad_input.device());
  cudaStream_t stream = cuda::current_stream(grad_input.device());
  dispatch_floating(grad_input.dtype(), "cross_entropy_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    const unsigned blocks = unsigned(std::min<int64_t>((count + kThreads - 1) / kThreads, 65535 * 8));
    cross_entropy_backward_kernel_cuda<T><<<blocks, kThreads, 0, stream>>>(
        grad_input.data<T>(), grad_loss.data<A>(), log_probs.data<T>(), target.data<int64_t>(),
        weight.defined() ? weight.data<A>() : nullptr, count, classes, inner, ignore_index);
    HG_CUDA_CHECK_LAUNCH("cross_entropy_backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(cross_entropy_backward_kernel, CUDA, cross_entropy_backward_cuda);
HG_REGISTER_KERNEL(nll_loss_kernel, CUDA, nll_loss_cuda);
HG_REGISTER_KERNEL(nll_loss_backward_kernel, CUDA, nll_loss_backward_cuda);

}  // namespace halfgrad
