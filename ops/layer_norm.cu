// layer_norm on CUDA: the kernels behind layer_norm_forward_kernel and layer_norm_backward_kernel
// (ops/layer_norm.h). The op layer hands over contiguous [rows, cols] tensors.
//
//   rows      (the forward and the input's gradient): TX threads share a row, ROWS rows per block, the shape
//             softmax's rows take (launch_rows, ops/log_sum_exp.cuh): a warp per row up to 1024 columns, eight rows
//             per block, the row held in registers between its passes (the forward: x; the input's gradient: g w and
//             xhat); longer rows a block of 512 each, which reads the row again for each pass, from L1/L2 for all but
//             very long rows.
//   columns   (weight's and bias's gradients, sums over the rows): a block of 32 columns x 8 rows walks a chunk of
//             rows, neighbouring threads on neighbouring columns (coalesced); each chunk writes its partial sums in
//             float32/float64, and a second kernel adds a column's chunks in order: no atomics, the same bits on
//             every run.
// float16/bfloat16 are computed in float32; float64 in float64.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda.h"
#include "ops/layer_norm.h"
#include "ops/log_sum_exp.cuh"

namespace halfgrad {
namespace {

using log_sum_exp::AddOp;
using log_sum_exp::launch_rows;
using log_sum_exp::row_blocks;
using log_sum_exp::row_reduce;

__device__ __forceinline__ float device_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double device_rsqrt(double x) { return ::rsqrt(x); }

// A warp's row is read from memory into registers once, K values a lane, all its loads in flight together; the later
// passes over it read the registers. K is the smallest of 2, 8 and 32 that holds the row (launch_rows gives a warp
// rows of up to kWarpRowMax = 32 x 32 columns): short rows keep few registers, so that many warps fit an SM. The
// longer rows of the block path (K = 0) read the row again for each pass, from L1/L2.
template <int TX, typename Launch> void with_row_slots(int64_t cols, Launch&& launch) {
  static_assert(log_sum_exp::kWarpRowMax == 32 * 32, "the largest slot count holds a warp's longest row");
  if constexpr (TX != 32) {
    launch.template operator()<0>();
  } else if (cols <= 2 * TX) {
    launch.template operator()<2>();
  } else if (cols <= 8 * TX) {
    launch.template operator()<8>();
  } else {
    HG_CHECK(cols <= 32 * TX, "layer_norm: a warp's row of {} columns is longer than its registers hold", cols);
    launch.template operator()<32>();
  }
}

// Calls f(k, j) for the columns j of this thread's part of a row: unrolled over the row's K register slots (k the
// slot, j = lane + TX k, past the row's end skipped) where K > 0, else a loop with stride TX (k always 0).
template <int TX, int K, typename F> __device__ __forceinline__ void for_each_column(int64_t cols, F&& f) {
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * TX;
      if (j < cols) f(k, j);
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += TX) f(0, j);
  }
}

template <typename T, int TX, int ROWS, int K>
__global__ void __launch_bounds__(TX * ROWS)
    forward_rows_kernel(T* y, opmath_t<T>* mean, opmath_t<T>* rstd, const T* x, const T* w, const T* b, int64_t rows,
                        int64_t cols, opmath_t<T> eps) {
  using A = opmath_t<T>;
  const int64_t row = int64_t(blockIdx.x) * ROWS + threadIdx.y;
  if (row >= rows) return;  // whole rows only: every thread of a row takes part in its reductions
  const T* xr = x + row * cols;
  A held[K > 0 ? K : 1] = {};
  auto value = [&](int k, int64_t j) {
    if constexpr (K > 0) return held[k];
    else return A(xr[j]);
  };
  if constexpr (K > 0) for_each_column<TX, K>(cols, [&](int k, int64_t j) { held[k] = A(xr[j]); });
  A sum = 0;
  for_each_column<TX, K>(cols, [&](int k, int64_t j) { sum += value(k, j); });
  const A m = row_reduce<TX>(sum, AddOp{}) / A(cols);
  A squares = 0;
  for_each_column<TX, K>(cols, [&](int k, int64_t j) {
    const A d = value(k, j) - m;
    squares += d * d;
  });
  const A rs = device_rsqrt(row_reduce<TX>(squares, AddOp{}) / A(cols) + eps);
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
  T* yr = y + row * cols;
  for_each_column<TX, K>(cols, [&](int k, int64_t j) {
    A v = (value(k, j) - m) * rs;
    if (w) v *= A(w[j]);
    if (b) v += A(b[j]);
    yr[j] = T(v);
  });
}

// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = g * w; a warp's row keeps gw and xhat in registers.
template <typename T, int TX, int ROWS, int K>
__global__ void __launch_bounds__(TX * ROWS)
    grad_input_rows_kernel(T* dx, const T* g, const T* x, const T* w, const opmath_t<T>* mean,
                           const opmath_t<T>* rstd, int64_t rows, int64_t cols) {
  using A = opmath_t<T>;
  const int64_t row = int64_t(blockIdx.x) * ROWS + threadIdx.y;
  if (row >= rows) return;
  const T *xr = x + row * cols, *gr = g + row * cols;
  const A m = mean[row], rs = rstd[row];
  auto gw_at = [&](int64_t j) { return w ? A(gr[j]) * A(w[j]) : A(gr[j]); };
  auto xhat_at = [&](int64_t j) { return (A(xr[j]) - m) * rs; };
  A held_gw[K > 0 ? K : 1] = {}, held_xhat[K > 0 ? K : 1] = {};
  A sum_gw = 0, sum_gw_xhat = 0;
  for_each_column<TX, K>(cols, [&](int k, int64_t j) {
    const A gw = gw_at(j), xhat = xhat_at(j);
    if constexpr (K > 0) {
      held_gw[k] = gw;
      held_xhat[k] = xhat;
    }
    sum_gw += gw;
    sum_gw_xhat += gw * xhat;
  });
  const A mean_gw = row_reduce<TX>(sum_gw, AddOp{}) / A(cols);
  const A mean_gw_xhat = row_reduce<TX>(sum_gw_xhat, AddOp{}) / A(cols);
  T* dr = dx + row * cols;
  for_each_column<TX, K>(cols, [&](int k, int64_t j) {
    const A gw = K > 0 ? held_gw[k] : gw_at(j), xhat = K > 0 ? held_xhat[k] : xhat_at(j);
    dr[j] = T(rs * (gw - mean_gw - xhat * mean_gw_xhat));
  });
}

constexpr int kColumnTile = 32, kRowLanes = 8;

// Partial sums of g * xhat and g over rows [chunk * rows_per_chunk, +rows_per_chunk) of 32 columns:
// partial_w/partial_b [chunks, cols].
template <typename T>
__global__ void __launch_bounds__(kColumnTile * kRowLanes)
    parameter_partials_kernel(opmath_t<T>* partial_w, opmath_t<T>* partial_b, const T* g, const T* x,
                              const opmath_t<T>* mean, const opmath_t<T>* rstd, int64_t rows, int64_t cols,
                              int64_t rows_per_chunk) {
  using A = opmath_t<T>;
  __shared__ A tile_w[kRowLanes][kColumnTile + 1], tile_b[kRowLanes][kColumnTile + 1];
  const int64_t col = int64_t(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t first = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  A sum_w = 0, sum_b = 0;
  if (col < cols) {
    for (int64_t r = first + threadIdx.y; r < end; r += kRowLanes) {
      const A gv = A(g[r * cols + col]);
      sum_w += gv * ((A(x[r * cols + col]) - mean[r]) * rstd[r]);
      sum_b += gv;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = sum_w;
  tile_b[threadIdx.y][threadIdx.x] = sum_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int lane = 1; lane < kRowLanes; ++lane) {
      sum_w += tile_w[lane][threadIdx.x];
      sum_b += tile_b[lane][threadIdx.x];
    }
    partial_w[int64_t(blockIdx.y) * cols + col] = sum_w;
    partial_b[int64_t(blockIdx.y) * cols + col] = sum_b;
  }
}

template <typename T>
__global__ void parameter_sums_kernel(T* dw, T* db, const opmath_t<T>* partial_w, const opmath_t<T>* partial_b,
                                      int64_t chunks, int64_t cols) {
  using A = opmath_t<T>;
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  A sum_w = 0, sum_b = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    sum_w += partial_w[c * cols + col];
    sum_b += partial_b[c * cols + col];
  }
  if (dw) dw[col] = T(sum_w);
  if (db) db[col] = T(sum_b);
}

// ---- launchers

constexpr int64_t kRowsPerChunk = 256;  // the parameters' sums: rows a block walks (more chunks for more rows)
constexpr int64_t kMaxChunks = 1024;

unsigned blocks_for(int64_t items, int64_t per_block) { return unsigned((items + per_block - 1) / per_block); }

// The rows' blocks must fit the grid's x dimension (launch_rows); the parameters' chunking divides by the row count.
void check_shape(const LayerNormShape& s) {
  HG_CHECK(s.rows > 0 && s.cols > 0 && row_blocks(s.rows, s.cols) < (int64_t(1) << 31), "layer_norm: the CUDA kernels "
           "take rows of at least one column, at most 2^31 - 1 blocks of them, got [{}, {}]", s.rows, s.cols);
}

void layer_norm_forward_cuda(const LayerNormForwardArgs& a) {
  check_shape(a.shape);
  cuda::DeviceGuard guard(a.input.device());
  cudaStream_t stream = cuda::current_stream(a.input.device());
  const LayerNormShape s = a.shape;
  dispatch_floating(a.input.dtype(), "layer_norm", [&]<typename T>() {
    using A = opmath_t<T>;
    const T* w = a.weight.defined() ? a.weight.data<T>() : nullptr;
    const T* b = a.bias.defined() ? a.bias.data<T>() : nullptr;
    launch_rows(s.rows, s.cols, [&]<int TX, int ROWS>(dim3 grid, dim3 block) {
      with_row_slots<TX>(s.cols, [&]<int K>() {
        forward_rows_kernel<T, TX, ROWS, K><<<grid, block, 0, stream>>>(a.output.data<T>(), a.mean.data<A>(),
                                                                        a.rstd.data<A>(), a.input.data<T>(), w, b,
                                                                        s.rows, s.cols, A(a.eps));
      });
    });
    HG_CUDA_CHECK_LAUNCH("layer_norm");
  });
}

void layer_norm_backward_cuda(const LayerNormBackwardArgs& a) {
  check_shape(a.shape);
  cuda::DeviceGuard guard(a.input.device());
  cudaStream_t stream = cuda::current_stream(a.input.device());
  const LayerNormShape s = a.shape;
  dispatch_floating(a.input.dtype(), "layer_norm_backward", [&]<typename T>() {
    using A = opmath_t<T>;
    const T* x = a.input.data<T>();
    const T* g = a.grad_output.data<T>();
    const A* mean = a.mean.data<A>();
    const A* rstd = a.rstd.data<A>();
    if (a.grad_input.defined()) {
      const T* w = a.weight.defined() ? a.weight.data<T>() : nullptr;
      launch_rows(s.rows, s.cols, [&]<int TX, int ROWS>(dim3 grid, dim3 block) {
        with_row_slots<TX>(s.cols, [&]<int K>() {
          grad_input_rows_kernel<T, TX, ROWS, K><<<grid, block, 0, stream>>>(a.grad_input.data<T>(), g, x, w, mean,
                                                                             rstd, s.rows, s.cols);
        });
      });
      HG_CUDA_CHECK_LAUNCH("layer_norm_backward");
    }
    if (!a.grad_weight.defined() && !a.grad_bias.defined()) return;
    const int64_t chunks = std::min(kMaxChunks, (s.rows + kRowsPerChunk - 1) / kRowsPerChunk);
    const int64_t rows_per_chunk = (s.rows + chunks - 1) / chunks;
    const TensorOptions accumulation{.dtype = a.mean.dtype(), .device = a.input.device()};
    Tensor partial_w = empty({chunks, s.cols}, accumulation), partial_b = empty({chunks, s.cols}, accumulation);
    parameter_partials_kernel<T><<<dim3(blocks_for(s.cols, kColumnTile), unsigned(chunks)),
                                   dim3(kColumnTile, kRowLanes), 0, stream>>>(
        partial_w.data<A>(), partial_b.data<A>(), g, x, mean, rstd, s.rows, s.cols, rows_per_chunk);
    HG_CUDA_CHECK_LAUNCH("layer_norm_backward");
    parameter_sums_kernel<T><<<blocks_for(s.cols, 256), 256, 0, stream>>>(
        a.grad_weight.defined() ? a.grad_weight.data<T>() : nullptr,
        a.grad_bias.defined() ? a.grad_bias.data<T>() : nullptr, partial_w.data<A>(), partial_b.data<A>(), chunks,
        s.cols);
    HG_CUDA_CHECK_LAUNCH("layer_norm_backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(layer_norm_forward_kernel, CUDA, layer_norm_forward_cuda);
HG_REGISTER_KERNEL(layer_norm_backward_kernel, CUDA, layer_norm_backward_cuda);

}  // namespace halfgrad
