// Loss kernels on CUDA: nll_loss's gather (forward) and scatter (backward), behind nll_loss_kernel and
// nll_loss_backward_kernel, and cross_entropy's one-pass forward and backward, cross_entropy_kernel and
// cross_entropy_backward_kernel (ops/loss.h). The other losses are tensor-op compositions (ops/loss.cpp).
//
// nll_loss: one thread per target element; cross_entropy: a block per row where a row's logits lie together (inner
// == 1), else a thread per row (below). A target outside [0, C) that is not ignore_index stops the kernel with a
// device-side assertion after printing the target, its position and C (the CPU kernel throws instead; a
// host-side check would cost a device synchronisation on every call).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "core/cuda.h"
#include "ops/log_sum_exp.cuh"
#include "ops/loss.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256;

// The loss of target element k, -w[t] log_prob(t), and its weight w[t]; both 0 where t == ignore_index. log_prob is
// the input itself (nll_loss) or (logit - row max) - log-sum, as log_softmax's (cross_entropy).
template <typename A, typename LogProb>
__device__ __forceinline__ void write_target_loss(A* loss, A* weights, int64_t k, const int64_t* target,
                                                  const A* weight, int64_t classes, int64_t ignore_index,
                                                  LogProb log_prob) {
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
  const A wc = weight ? weight[c] : A(1);
  loss[k] = -wc * log_prob(c);
  weights[k] = wc;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    nll_loss_kernel_cuda(opmath_t<T>* loss, opmath_t<T>* weights, const T* input, const int64_t* target,
                         const opmath_t<T>* weight, int64_t count, int64_t classes, int64_t inner,
                         int64_t ignore_index) {
  using A = opmath_t<T>;
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const int64_t n = k / inner, i = k % inner;
  write_target_loss(loss, weights, k, target, weight, classes, ignore_index,
                    [&](int64_t c) { return A(input[(n * classes + c) * inner + i]); });
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

// ---- cross_entropy (class indices): rows of inner == 1 get a block each, read in 16-byte vectors; rows of
// inner > 1 (per-pixel logits) a thread each, neighbouring threads reading neighbouring pixels.

constexpr int kRowThreads = 512;

// Calls f(j, x) for every element j of a row of n elements that this thread takes (the block shares the row): a
// scalar head up to the first 16-byte boundary, whole vectors, a scalar tail.
template <typename T, typename F> __device__ __forceinline__ void for_each_in_row(const T* x, int64_t n, F f) {
  constexpr int V = Vec16<T>::kSize;
  const int64_t misaligned = int64_t(reinterpret_cast<uintptr_t>(x) % 16 / sizeof(T));
  const int64_t head = min(n, misaligned == 0 ? int64_t(0) : V - misaligned);
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) f(j, x[j]);
  const int64_t vectors = (n - head) / V;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + head);
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    const Vec16<T> val = xv[v];
#pragma unroll
    for (int k = 0; k < V; ++k) f(head + v * V + k, val.v[k]);
  }
  for (int64_t j = head + vectors * V + threadIdx.x; j < n; j += blockDim.x) f(j, x[j]);
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_rows_kernel(opmath_t<T>* loss, opmath_t<T>* weights, opmath_t<T>* row_max, opmath_t<T>* log_sum,
                              const T* input, const int64_t* target, const opmath_t<T>* weight, int64_t classes,
                              int64_t ignore_index) {
  using A = opmath_t<T>;
  using namespace log_sum_exp;
  const int64_t row = blockIdx.x;
  const T* x = input + row * classes;
  MaxSum<A> st{-INFINITY, A(0)};
  for_each_in_row(x, classes, [&](int64_t, T v) { st = add_element(st, A(v)); });
  st = row_reduce<kRowThreads>(st, MergeOp{});
  if (threadIdx.x != 0) return;
  const A ls = device_log(st.s);
  row_max[row] = st.m;
  log_sum[row] = ls;
  write_target_loss(loss, weights, row, target, weight, classes, ignore_index,
                    [&](int64_t c) { return (A(x[c]) - st.m) - ls; });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_columns_kernel(opmath_t<T>* loss, opmath_t<T>* weights, opmath_t<T>* row_max, opmath_t<T>* log_sum,
                                 const T* input, const int64_t* target, const opmath_t<T>* weight, int64_t count,
                                 int64_t classes, int64_t inner, int64_t ignore_index) {
  using A = opmath_t<T>;
  using namespace log_sum_exp;
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const T* x = input + (k / inner) * classes * inner + k % inner;
  MaxSum<A> st{-INFINITY, A(0)};
  for (int64_t j = 0; j < classes; ++j) st = add_element(st, A(x[j * inner]));
  const A ls = device_log(st.s);
  row_max[k] = st.m;
  log_sum[k] = ls;
  write_target_loss(loss, weights, k, target, weight, classes, ignore_index,
                    [&](int64_t c) { return (A(x[c * inner]) - st.m) - ls; });
}

// The gradient's scale for one (n, i): grad_loss w[t], 0 where t is ignored.
template <typename A>
__device__ __forceinline__ A cross_entropy_scale(int64_t k, const A* grad_loss, const int64_t* target, const A* weight,
                                                 int64_t ignore_index) {
  const int64_t c = target[k];
  return c == ignore_index ? A(0) : grad_loss[k] * (weight ? weight[c] : A(1));
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_backward_rows_kernel(T* grad_input, const opmath_t<T>* grad_loss, const T* input,
                                       const opmath_t<T>* row_max, const opmath_t<T>* log_sum, const int64_t* target,
                                       const opmath_t<T>* weight, int64_t classes, int64_t ignore_index) {
  using A = opmath_t<T>;
  using log_sum_exp::device_exp;
  const int64_t row = blockIdx.x, c = target[row];
  const A scale = cross_entropy_scale(row, grad_loss, target, weight, ignore_index), m = row_max[row],
          ls = log_sum[row];
  const T* x = input + row * classes;
  T* g = grad_input + row * classes;
  auto grad = [&](int64_t j, T v) { return T(scale * (device_exp((A(v) - m) - ls) - (j == c ? A(1) : A(0)))); };
  if ((reinterpret_cast<uintptr_t>(x) - reinterpret_cast<uintptr_t>(g)) % 16 != 0) {  // vectors would not line up
    for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) g[j] = grad(j, x[j]);
    return;
  }
  constexpr int V = Vec16<T>::kSize;
  const int64_t misaligned = int64_t(reinterpret_cast<uintptr_t>(x) % 16 / sizeof(T));
  const int64_t head = min(classes, misaligned == 0 ? int64_t(0) : V - misaligned);
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) g[j] = grad(j, x[j]);
  const int64_t vectors = (classes - head) / V;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + head);
  Vec16<T>* gv = reinterpret_cast<Vec16<T>*>(g + head);
  for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    const Vec16<T> in = xv[v];
    Vec16<T> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = grad(head + v * V + k, in.v[k]);
    gv[v] = out;
  }
  for (int64_t j = head + vectors * V + threadIdx.x; j < classes; j += blockDim.x) g[j] = grad(j, x[j]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_backward_columns_kernel(T* grad_input, const opmath_t<T>* grad_loss, const T* input,
                                          const opmath_t<T>* row_max, const opmath_t<T>* log_sum,
                                          const int64_t* target, const opmath_t<T>* weight, int64_t count,
                                          int64_t classes, int64_t inner, int64_t ignore_index) {
  using A = opmath_t<T>;
  using log_sum_exp::device_exp;
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const int64_t c = target[k], base = (k / inner) * classes * inner + k % inner;
  const A scale = cross_entropy_scale(k, grad_loss, target, weight, ignore_index), m = row_max[k], ls = log_sum[k];
  for (int64_t j = 0; j < classes; ++j) {
    const A p = device_exp((A(input[base + j * inner]) - m) - ls);
    grad_input[base + j * inner] = T(scale * (p - (j == c ? A(1) : A(0))));
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

void cross_entropy_cuda(const Tensor& loss, const Tensor& weights, const Tensor& row_max, const Tensor& log_sum,
                        const Tensor& input, const Tensor& target, const Tensor& weight, int64_t ignore_index) {
  const int64_t batch = input.size(0), classes = input.size(1), inner = input.size(2), count = target.numel();
  if (count == 0) return;
  cuda::DeviceGuard guard(input.device());
  cudaStream_t stream = cuda::current_stream(input.device());
  dispatch_floating(input.dtype(), "cross_entropy", [&]<typename T>() {
    using A = opmath_t<T>;
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    if (inner == 1) {
      cross_entropy_rows_kernel<T><<<unsigned(batch), kRowThreads, 0, stream>>>(
          loss.data<A>(), weights.data<A>(), row_max.data<A>(), log_sum.data<A>(), input.data<T>(),
          target.data<int64_t>(), w, classes, ignore_index);
    } else {
      cross_entropy_columns_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(
          loss.data<A>(), weights.data<A>(), row_max.data<A>(), log_sum.data<A>(), input.data<T>(),
          target.data<int64_t>(), w, count, classes, inner, ignore_index);
    }
    HG_CUDA_CHECK_LAUNCH("cross_entropy");
  });
}

void cross_entropy_backward_cuda(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& input,
                                 const Tensor& row_max, const Tensor& log_sum, const Tensor& target,
                                 const Tensor& weight, int64_t ignore_index) {
  const int64_t batch = grad_input.size(0), classes = grad_input.size(1), inner = grad_input.size(2);
  const int64_t count = target.numel();
  if (count == 0 || classes == 0) return;
  cuda::DeviceGuard guard(grad_input.device());
  cudaStream_t stream = cuda::current_stream(grad_input.device());
  dispatch_floating(grad_input.dtype(), "cross_entropy_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    if (inner == 1) {
      cross_entropy_backward_rows_kernel<T><<<unsigned(batch), kRowThreads, 0, stream>>>(
          grad_input.data<T>(), grad_loss.data<A>(), input.data<T>(), row_max.data<A>(), log_sum.data<A>(),
          target.data<int64_t>(), w, classes, ignore_index);
    } else {
      cross_entropy_backward_columns_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(
          grad_input.data<T>(), grad_loss.data<A>(), input.data<T>(), row_max.data<A>(), log_sum.data<A>(),
          target.data<int64_t>(), w, count, classes, inner, ignore_index);
    }
    HG_CUDA_CHECK_LAUNCH("cross_entropy_backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(cross_entropy_kernel, CUDA, cross_entropy_cuda);
HG_REGISTER_KERNEL(cross_entropy_backward_kernel, CUDA, cross_entropy_backward_cuda);
HG_REGISTER_KERNEL(nll_loss_kernel, CUDA, nll_loss_cuda);
HG_REGISTER_KERNEL(nll_loss_backward_kernel, CUDA, nll_loss_backward_cuda);

}  // namespace halfgrad
