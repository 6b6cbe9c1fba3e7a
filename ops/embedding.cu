// embedding on CUDA: the kernels behind embedding_kernel and embedding_backward_kernel (ops/embedding.h).
//
// Forward: one thread per output element; neighbouring threads copy neighbouring columns of one row.
// Backward: one thread per gradient element, atomicAdd into a float32 (float64) grad_weight, so repeated
// indices accumulate in full precision whatever the gradient's dtype.
// An index outside [0, V) stops the forward kernel with a device-side assertion after printing the index,
// its position and V (checking on the host would synchronise the device on every call; the op checks them there only
// for a weight of no columns, where no thread runs).
#include <cuda_runtime.h>

#include <cstdio>
#include <type_traits>

#include "core/cuda.h"
#include "ops/embedding.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    embedding_kernel_cuda(T* out, const T* weight, const int64_t* indices, int64_t count, int64_t dim, int64_t rows) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= count) return;
  const int64_t k = e / dim, d = e % dim, row = indices[k];
  if (row < 0 || row >= rows) {
    if (d == 0) {
      printf("embedding (or index_select): index %lld at position %lld is out of range for %lld rows\n",
             (long long)row, (long long)k, (long long)rows);
    }
    __assert_fail("embedding index in [0, V)", __FILE__, __LINE__, __func__);
  }
  out[e] = weight[row * dim + d];
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel_cuda(A* grad_weight, const T* grad, const int64_t* indices, int64_t count, int64_t dim,
                                   int64_t padding_idx) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= count) return;
  const int64_t k = e / dim, d = e % dim, row = indices[k];
  if (row == padding_idx) return;
  atomicAdd(grad_weight + row * dim + d, A(opmath_t<T>(grad[e])));
}

unsigned blocks_for(int64_t count) { return unsigned((count + kThreads - 1) / kThreads); }

void embedding_cuda(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  const int64_t rows = weight.size(0), dim = weight.size(1), count = indices.numel() * dim;
  if (count == 0) return;
  cuda::DeviceGuard guard(weight.device());
  cudaStream_t stream = cuda::current_stream(weight.device());
  dispatch_all(weight.dtype(), "embedding", [&]<typename T>() {  // any dtype: index_select gathers integers too
    embedding_kernel_cuda<T><<<blocks_for(count), kThreads, 0, stream>>>(out.data<T>(), weight.data<T>(),
                                                                        indices.data<int64_t>(), count, dim, rows);
    HG_CUDA_CHECK_LAUNCH("embedding");
  });
}

void embedding_backward_cuda(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices, int64_t padding_idx) {
  const int64_t dim = grad.size(1), count = indices.numel() * dim;
  if (count == 0) return;
  cuda::DeviceGuard guard(grad.device());
  cudaStream_t stream = cuda::current_stream(grad.device());
  dispatch_floating(grad.dtype(), "embedding_backward", [&]<typename T>() {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    embedding_backward_kernel_cuda<T, A><<<blocks_for(count), kThreads, 0, stream>>>(
        grad_weight.data<A>(), grad.data<T>(), indices.data<int64_t>(), count, dim, padding_idx);
    HG_CUDA_CHECK_LAUNCH("embedding_backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(embedding_kernel, CUDA, embedding_cuda);
HG_REGISTER_KERNEL(embedding_backward_kernel, CUDA, embedding_backward_cuda);

}  // namespace halfgrad
