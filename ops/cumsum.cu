// cumsum on CUDA: the kernel behind cumsum_kernel (ops/cumsum.h), two shapes of [outer, length, inner]:
//   rows     (inner 1): a block a row walks it in tiles of kThreads x kItems values, each tile one block-wide scan
//            (cub::BlockScan) plus the running total of the tiles before it;
//   columns  (inner > 1): a thread a column walks it down the length in order, neighbouring threads on neighbouring
//            columns (coalesced). Few long columns leave the GPU idle, as PyTorch's scan would not: a shape to move
//            the dim last for.
// float16/bfloat16 sums are carried in float32.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "core/cuda.h"
#include "ops/cumsum.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256, kItems = 4;

// a + b; integers wrapping, without signed overflow.
template <typename A> __device__ __forceinline__ A add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return A(U(U(a) + U(b)));
  } else {
    return a + b;
  }
}

struct Add {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return add(a, b); }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) cumsum_rows_kernel(T* out, const T* x, int64_t length, bool reverse) {
  using A = opmath_t<T>;
  using Scan = cub::BlockScan<A, kThreads>;
  __shared__ typename Scan::TempStorage scratch;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * length;
  T* yr = out + row * length;
  A carried = A(0);  // the sum of the tiles before this one
  for (int64_t tile = 0; tile < length; tile += int64_t(kThreads) * kItems) {
    A v[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int64_t p = tile + int64_t(threadIdx.x) * kItems + i;  // the position along the scan
      v[i] = p < length ? A(xr[reverse ? length - 1 - p : p]) : A(0);
    }
    A tile_sum;
    Scan(scratch).InclusiveScan(v, v, Add{}, tile_sum);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int64_t p = tile + int64_t(threadIdx.x) * kItems + i;
      if (p < length) yr[reverse ? length - 1 - p : p] = T(add(carried, v[i]));
    }
    carried = add(carried, tile_sum);
    __syncthreads();  // the scratch is reused by the next tile
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cumsum_columns_kernel(T* out, const T* x, int64_t outer, int64_t length, int64_t inner, bool reverse) {
  using A = opmath_t<T>;
  const int64_t column = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (column >= outer * inner) return;
  const int64_t start = (column / inner) * length * inner + column % inner;
  A sum = A(0);
  for (int64_t k = 0; k < length; ++k) {
    const int64_t at = start + (reverse ? length - 1 - k : k) * inner;
    sum = add(sum, A(x[at]));
    out[at] = T(sum);
  }
}

void cumsum_cuda(const Tensor& out, const Tensor& x, int64_t outer, int64_t length, int64_t inner, bool reverse) {
  if (out.numel() == 0) return;
  HG_CHECK(inner > 1 || outer < (int64_t(1) << 31), "cumsum: the CUDA kernel takes at most 2^31 - 1 rows, got {} of "
           "{}", outer, x.meta());
  cuda::DeviceGuard guard(out.device());
  cudaStream_t stream = cuda::current_stream(out.device());
  dispatch_numeric(out.dtype(), "cumsum", [&]<typename T>() {
    if (inner == 1) {
      cumsum_rows_kernel<T><<<unsigned(outer), kThreads, 0, stream>>>(out.data<T>(), x.data<T>(), length, reverse);
    } else {
      const unsigned blocks = unsigned((outer * inner + kThreads - 1) / kThreads);
      cumsum_columns_kernel<T><<<blocks, kThreads, 0, stream>>>(out.data<T>(), x.data<T>(), outer, length, inner,
                                                               reverse);
    }
    HG_CUDA_CHECK_LAUNCH("cumsum");
  });
}

}  // namespace

HG_REGISTER_KERNEL(cumsum_kernel, CUDA, cumsum_cuda);

}  // namespace halfgrad
