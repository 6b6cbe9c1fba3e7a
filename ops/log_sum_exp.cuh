#pragma once
// The softmax normaliser on CUDA, shared by softmax / log_softmax (ops/softmax.cu), cross_entropy (ops/loss.cu) and
// linear_cross_entropy (ops/linear_cross_entropy.cu): the running (max, sum of exp) pair of a set of elements, merged
// across the threads of a row. The row kernels read a row in 16-byte vectors (ops/vec16.cuh). row_reduce below serves
// any row-wise reduction (layer_norm's statistics too: ops/layer_norm.cu).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/vec16.cuh"

namespace halfgrad::log_sum_exp {

__device__ __forceinline__ float device_exp(float x) { return expf(x); }
__device__ __forceinline__ double device_exp(double x) { return ::exp(x); }
__device__ __forceinline__ float device_log(float x) { return logf(x); }
__device__ __forceinline__ double device_log(double x) { return ::log(x); }

// The softmax normaliser of a set of elements: their max m and s = sum exp(x - m). Two sets merge by
// rescaling each sum to the larger max; one element x is the set {m = x, s = 1}, but +inf is {+inf, nan}: its own
// term exp(inf - inf) is nan, as in PyTorch's two passes, so a row holding +inf normalises to nan throughout rather
// than to a one-hot of its infinities. A nan anywhere makes s nan.
template <typename A> struct MaxSum {
  A m, s;
};
template <typename A> __device__ __forceinline__ A own_term(A x) { return x == A(INFINITY) ? A(NAN) : A(1); }
template <typename A> __device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = a.m > b.m ? a.m : b.m;
  // (a.m == m also covers two empty sets, -inf and -inf, where a.m - m would be nan)
  const A sa = a.m == m ? a.s : a.s * device_exp(a.m - m);
  const A sb = b.m == m ? b.s : b.s * device_exp(b.m - m);
  return {m, sa + sb};
}
// merge(st, {x, 1}) with one exp, not two: the set st with the element x added.
template <typename A> __device__ __forceinline__ MaxSum<A> add_element(MaxSum<A> st, A x) {
  if (x > st.m) return {x, st.s * device_exp(st.m - x) + own_term(x)};
  if (x == st.m) return {st.m, st.s + own_term(x)};  // (also -inf into a set of -inf, where x - st.m would be nan)
  return {st.m, st.s + device_exp(x - st.m)};  // a nan x lands here and makes s nan
}
template <typename A> __device__ __forceinline__ MaxSum<A> shuffle_xor(MaxSum<A> v, int mask) {
  return {__shfl_xor_sync(0xffffffffu, v.m, mask), __shfl_xor_sync(0xffffffffu, v.s, mask)};
}
template <typename A> __device__ __forceinline__ A shuffle_xor(A v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

struct MergeOp {
  template <typename A> __device__ MaxSum<A> operator()(MaxSum<A> a, MaxSum<A> b) const { return merge(a, b); }
};
struct AddOp {  // a plain sum over a row (softmax's backward, layer_norm's statistics)
  template <typename A> __device__ A operator()(A a, A b) const { return a + b; }
};

// Reduces v over the TX threads of a row (threadIdx.x); every thread of the row gets the result. TX is 32
// (one warp per row, any number of rows per block) or a multiple of 32 with one row per block.
template <int TX, typename V, typename Op> __device__ __forceinline__ V row_reduce(V v, Op op) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) v = op(v, shuffle_xor(v, mask));
  if constexpr (TX > 32) {
    __shared__ V partial[TX / 32];
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = partial[0];
#pragma unroll
    for (int w = 1; w < TX / 32; ++w) v = op(v, partial[w]);
    __syncthreads();  // the partials may be reused by a second reduction
  }
  return v;
}

// The row shape of the row-wise kernels (softmax's, layer_norm's), whose TX threads of a row reduce with row_reduce:
// rows up to kWarpRowMax long get a warp each, eight rows to a block; longer ones a block of kLongRowThreads each.
// Calls launch.template operator()<TX, ROWS>(grid, block).
inline constexpr int64_t kWarpRowMax = 1024;
inline constexpr int kLongRowThreads = 512;
// The blocks launch_rows makes for `rows` rows of `cols` (the grid's x dimension holds 2^31 - 1).
inline int64_t row_blocks(int64_t rows, int64_t cols) { return cols <= kWarpRowMax ? (rows + 7) / 8 : rows; }
template <typename Launch> void launch_rows(int64_t rows, int64_t cols, Launch&& launch) {
  const dim3 grid(unsigned(row_blocks(rows, cols)));
  if (cols <= kWarpRowMax) {
    launch.template operator()<32, 8>(grid, dim3(32, 8));
  } else {
    launch.template operator()<kLongRowThreads, 1>(grid, dim3(kLongRowThreads, 1));
  }
}

}  // namespace halfgrad::log_sum_exp
