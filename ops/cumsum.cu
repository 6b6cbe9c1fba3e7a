// cumsum on CUDA: the kernel behind cumsum_kernel (ops/cumsum.h). [outer, length, inner] takes one of four paths:
//   rows of the dim last (inner 1), by their length and number:
//     short rows (up to kShortRow), or more than a grid holds: a thread a row walks it in order;
//     few long rows (few_long_rows, ops/cub_rows.cuh): cub::DeviceScan a row, all the GPU on each;
//     the rest: a block a row walks it in tiles of kThreads x kItems values, each tile one block-wide scan
//     (cub::BlockScan) plus the running total of the tiles before it;
//   columns (inner > 1): a thread a column walks it down the length in order, neighbouring threads on neighbouring
//     columns (coalesced); few columns longer than a short row (up to kFewColumns) would leave most of the GPU idle
//     ([1000000, 2] along dim 0: two threads, each a million dependent steps), so they are moved last, scanned as
//     rows and moved back (two more passes over the data, all the GPU on each).
// float16/bfloat16 sums are carried in float32; integers wrap.
#include <cuda_runtime.h>
#include <thrust/iterator/reverse_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include "core/cuda.h"
#include "ops/cub_rows.cuh"
#include "ops/cumsum.h"
#include "ops/elementwise_math.h"

namespace halfgrad {
namespace {

constexpr int kThreads = 256, kItems = 4;
constexpr int64_t kShortRow = 64, kFewColumns = 8192;

struct Add {
  template <typename A> __host__ __device__ __forceinline__ A operator()(A a, A b) const {
    return binary_math<BinaryOp::Add>(a, b);  // integers wrap
  }
};
template <typename T> struct Widen {
  __host__ __device__ __forceinline__ opmath_t<T> operator()(T v) const { return opmath_t<T>(v); }
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
      if (p < length) yr[reverse ? length - 1 - p : p] = T(Add{}(carried, v[i]));
    }
    carried = Add{}(carried, tile_sum);
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
    sum = Add{}(sum, A(x[at]));
    out[at] = T(sum);
  }
}

// Row by row, each scanned by all the GPU: cub::DeviceScan over x's row widened to opmath_t<T>, reversed for reverse.
template <typename T>
void cumsum_long_rows(T* out, const T* x, int64_t rows, int64_t length, bool reverse, Device device,
                      cudaStream_t stream) {
  run_with_cub_scratch(device, rows, [&](void* scratch, size_t& bytes, int64_t row) {
    const auto in = thrust::make_transform_iterator(x + row * length, Widen<T>{});
    T* row_out = out + row * length;
    if (reverse) {
      return cub::DeviceScan::InclusiveScan(scratch, bytes, thrust::make_reverse_iterator(in + length),
                                            thrust::make_reverse_iterator(row_out + length), Add{}, length, stream);
    }
    return cub::DeviceScan::InclusiveScan(scratch, bytes, in, row_out, Add{}, length, stream);
  });
}

void cumsum_cuda(const Tensor& out, const Tensor& x, int64_t outer, int64_t length, int64_t inner, bool reverse) {
  if (out.numel() == 0) return;
  if (inner > 1 && outer * inner <= kFewColumns && length > kShortRow) {  // few long columns: as rows
    const Tensor rows = x.view({outer, length, inner}).transpose(1, 2).contiguous();
    const Tensor scanned = empty_like(rows);
    cumsum_cuda(scanned, rows, outer * inner, length, 1, reverse);
    Tensor(out).view({outer, length, inner}).copy_(scanned.transpose(1, 2));
    return;
  }
  cuda::DeviceGuard guard(out.device());
  cudaStream_t stream = cuda::current_stream(out.device());
  dispatch_numeric(out.dtype(), "cumsum", [&]<typename T>() {
    if (inner == 1 && few_long_rows(outer, length)) {
      cumsum_long_rows<T>(out.data<T>(), x.data<T>(), outer, length, reverse, out.device(), stream);
      return;
    }
    if (inner == 1 && length > kShortRow && outer < (int64_t(1) << 31)) {
      cumsum_rows_kernel<T><<<unsigned(outer), kThreads, 0, stream>>>(out.data<T>(), x.data<T>(), length, reverse);
    } else {  // columns, or short rows as columns of one
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
