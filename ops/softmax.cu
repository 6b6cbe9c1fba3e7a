// softmax and log_softmax on CUDA: the kernels behind softmax_kernel and softmax_backward_kernel
// (ops/softmax.h). The op layer hands over contiguous [outer, size, inner] tensors.
//
//   rows    (inner == 1, the usual last-dim softmax): TX threads share a row, ROWS rows per block. Short
//           rows (size <= 1024): a warp per row, eight rows per block; long rows: a block of 512 per row.
//           Forward reads the row twice: once for the running (max, sum of exp) pair, merged across
//           threads with warp shuffles (and shared memory between warps), once to write.
//   columns (inner > 1, softmax over a non-last dim): one thread per (outer, inner) column walks the
//           softmax dim with stride `inner`; neighbouring threads read neighbouring columns (coalesced).
// float16/bfloat16 are computed in float32; float64 in float64.
#include <cuda_runtime.h>

#include "core/cuda.h"
#include "ops/log_sum_exp.cuh"
#include "ops/softmax.h"

namespace halfgrad {
namespace {

using namespace log_sum_exp;

constexpr int kColumnThreads = 256;

template <typename T, int TX, int ROWS>
__global__ void __launch_bounds__(TX * ROWS) softmax_rows_kernel(T* out, const T* in, int64_t outer, int64_t size,
                                                                 bool log) {
  using A = opmath_t<T>;
  const int64_t row = int64_t(blockIdx.x) * ROWS + threadIdx.y;
  if (row >= outer) return;  // whole rows only: every thread of a row takes part in its reduction
  const T* x = in + row * size;
  T* y = out + row * size;
  MaxSum<A> st{-INFINITY, A(0)};
  for (int64_t j = threadIdx.x; j < size; j += TX) st = add_element(st, A(x[j]));
  st = row_reduce<TX>(st, MergeOp{});
  if (log) {
    const A log_sum = device_log(st.s);  // (x - m) - log_sum: x - m is exact, m + log_sum would round
    for (int64_t j = threadIdx.x; j < size; j += TX) y[j] = T((A(x[j]) - st.m) - log_sum);
  } else {
    const A scale = A(1) / st.s;
    for (int64_t j = threadIdx.x; j < size; j += TX) y[j] = T(device_exp(A(x[j]) - st.m) * scale);
  }
}

template <typename T>
__global__ void __launch_bounds__(kColumnThreads) softmax_columns_kernel(T* out, const T* in, int64_t outer,
                                                                         int64_t size, int64_t inner, bool log) {
  using A = opmath_t<T>;
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= outer * inner) return;
  const int64_t o = column / inner, i = column % inner;
  const T* x = in + o * size * inner + i;
  T* y = out + o * size * inner + i;
  MaxSum<A> st{-INFINITY, A(0)};
  for (int64_t j = 0; j < size; ++j) st = add_element(st, A(x[j * inner]));
  if (log) {
    const A log_sum = device_log(st.s);
    for (int64_t j = 0; j < size; ++j) y[j * inner] = T((A(x[j * inner]) - st.m) - log_sum);
  } else {
    const A scale = A(1) / st.s;
    for (int64_t j = 0; j < size; ++j) y[j * inner] = T(device_exp(A(x[j * inner]) - st.m) * scale);
  }
}

// softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g).
template <typename T, int TX, int ROWS>
__global__ void __launch_bounds__(TX * ROWS) softmax_backward_rows_kernel(T* dx, const T* g, const T* y,
                                                                          int64_t outer, int64_t size, bool log) {
  using A = opmath_t<T>;
  const int64_t row = int64_t(blockIdx.x) * ROWS + threadIdx.y;
  if (row >= outer) return;
  const int64_t base = row * size;
  A r = 0;
  for (int64_t j = threadIdx.x; j < size; j += TX) r += log ? A(g[base + j]) : A(g[base + j]) * A(y[base + j]);
  r = row_reduce<TX>(r, AddOp{});
  for (int64_t j = threadIdx.x; j < size; j += TX) {
    const A gj = A(g[base + j]), yj = A(y[base + j]);
    dx[base + j] = T(log ? gj - device_exp(yj) * r : yj * (gj - r));
  }
}

template <typename T>
__global__ void __launch_bounds__(kColumnThreads)
    softmax_backward_columns_kernel(T* dx, const T* g, const T* y, int64_t outer, int64_t size, int64_t inner,
                                    bool log) {
  using A = opmath_t<T>;
  const int64_t column = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= outer * inner) return;
  const int64_t base = (column / inner) * size * inner + column % inner;
  A r = 0;
  for (int64_t j = 0; j < size; ++j) {
    const int64_t at = base + j * inner;
    r += log ? A(g[at]) : A(g[at]) * A(y[at]);
  }
  for (int64_t j = 0; j < size; ++j) {
    const int64_t at = base + j * inner;
    const A gj = A(g[at]), yj = A(y[at]);
    dx[at] = T(log ? gj - device_exp(yj) * r : yj * (gj - r));
  }
}

// ---- launchers

unsigned blocks_for(int64_t items, int64_t per_block) { return unsigned((items + per_block - 1) / per_block); }

void softmax_cuda(const Tensor& out, const Tensor& in, SoftmaxShape s, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  HG_CHECK(in.is_contiguous() && out.is_contiguous() && in.device() == out.device(),
           "{}: softmax_cuda expects contiguous operands on one device, got {} and {}", name, in.meta(), out.meta());
  cuda::DeviceGuard guard(in.device());
  cudaStream_t stream = cuda::current_stream(in.device());
  dispatch_floating(in.dtype(), name, [&]<typename T>() {
    T* y = out.data<T>();
    const T* x = in.data<T>();
    if (s.inner == 1) {
      launch_rows(s.outer, s.size, [&]<int TX, int ROWS>(dim3 grid, dim3 block) {
        softmax_rows_kernel<T, TX, ROWS><<<grid, block, 0, stream>>>(y, x, s.outer, s.size, log);
      });
    } else {
      softmax_columns_kernel<T><<<blocks_for(s.outer * s.inner, kColumnThreads), kColumnThreads, 0, stream>>>(
          y, x, s.outer, s.size, s.inner, log);
    }
    HG_CUDA_CHECK_LAUNCH(name);
  });
}

void softmax_backward_cuda(const Tensor& grad_in, const Tensor& grad_out, const Tensor& out, SoftmaxShape s, bool log) {
  const char* name = log ? "log_softmax_backward" : "softmax_backward";
  HG_CHECK(grad_in.is_contiguous() && grad_out.is_contiguous() && out.is_contiguous(),
           "{}: softmax_backward_cuda expects contiguous operands, got {}, {} and {}", name, grad_in.meta(),
           grad_out.meta(), out.meta());
  cuda::DeviceGuard guard(out.device());
  cudaStream_t stream = cuda::current_stream(out.device());
  dispatch_floating(out.dtype(), name, [&]<typename T>() {
    T* dx = grad_in.data<T>();
    const T* g = grad_out.data<T>();
    const T* y = out.data<T>();
    if (s.inner == 1) {
      launch_rows(s.outer, s.size, [&]<int TX, int ROWS>(dim3 grid, dim3 block) {
        softmax_backward_rows_kernel<T, TX, ROWS><<<grid, block, 0, stream>>>(dx, g, y, s.outer, s.size, log);
      });
    } else {
      softmax_backward_columns_kernel<T><<<blocks_for(s.outer * s.inner, kColumnThreads), kColumnThreads, 0, stream>>>(
          dx, g, y, s.outer, s.size, s.inner, log);
    }
    HG_CUDA_CHECK_LAUNCH(name);
  });
}

}  // namespace

HG_REGISTER_KERNEL(softmax_kernel, CUDA, softmax_cuda);
HG_REGISTER_KERNEL(softmax_backward_kernel, CUDA, softmax_backward_cuda);

}  // namespace halfgrad
