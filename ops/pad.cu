// pad on CUDA: the kernels behind pad_kernel and pad_backward_kernel (ops/pad.h), a thread for kUnroll output elements
// (the forward, and Constant padding's backward on the transposed geometry) or for an input element (the others'
// backward), each running the rule ops/pad.h writes once for both devices.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda.h"
#include "core/dtype.h"
#include "ops/pad.h"

namespace halfgrad {
namespace {

// The forward's thread takes kUnroll elements kThreads apart, so that a warp reads and writes each of its kUnroll rows
// of elements together and a thread has its kUnroll reads in flight at once: with one, it waited out each read's
// latency alone (docs/benchmarks.md, session 73: 9-11% quicker). The gradient's walks stay one a thread: four a thread
// waited for more edge elements' walks in turn, and were slower.
constexpr int kThreads = 256, kUnroll = 4, kTile = kThreads * kUnroll;

// Blocks of `per_block` elements for n, at most 2^20 (then grid-stride).
unsigned blocks_for(int64_t n, int per_block) {
  return unsigned(std::min<int64_t>((n + per_block - 1) / per_block, int64_t(1) << 20));
}

// The sizes of the side a kernel walks (the output's for the forward, the input's for the gradient) as its 32-bit walk
// divides by them (pad_coordinate). That side has elements (nothing is launched for an empty one), fewer than 2^29
// where the walk is 32-bit (pad_fits_32_bits): every size is in [1, 2^29). The other side may have dims of 0. Unused
// by the 64-bit walks, which divide by the sizes themselves.
struct PadDivisors {
  IntDivider of[kMaxPadDims];
};
PadDivisors divisors_of(const int64_t (&sizes)[kMaxPadDims], int dims) {
  PadDivisors divisors;
  for (int d = 0; d < dims; ++d) divisors.of[d] = IntDivider{uint32_t(sizes[d])};
  return divisors;
}
template <typename I> __device__ const auto* walk_sizes(const int64_t* sizes, const IntDivider* divisors) {
  if constexpr (std::is_same_v<I, int32_t>) return divisors;
  else return sizes;
}

// I: the index type, int32_t where every index of both tensors fits (pad_fits_32_bits). The divisors are read where
// they lie, among the kernel's parameters, through the pointer walk_sizes gives: __grid_constant__ lets a kernel take
// a parameter's address without the copy to local memory (96 bytes a thread) it otherwise makes.
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) pad_cuda_kernel(T* out, const T* x, PadGeometry geometry,
                                                            const __grid_constant__ PadDivisors out_divisors, T fill,
                                                            I n) {
  const auto* out_sizes = walk_sizes<I>(geometry.out, out_divisors.of);
  for (I first = I(blockIdx.x) * kTile + I(threadIdx.x); first < n; first += I(gridDim.x) * kTile) {
    I source[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const I k = first + j * kThreads;
      source[j] = k < n ? pad_source_index(geometry, out_sizes, k) : -1;
    }
    T value[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) value[j] = source[j] < 0 ? fill : x[source[j]];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (first + j * kThreads < n) out[first + j * kThreads] = value[j];
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) pad_backward_cuda_kernel(T* grad_input, const T* grad_output,
                                                                     PadGeometry geometry,
                                                                     const __grid_constant__ PadDivisors in_divisors,
                                                                     I n) {
  const auto* in_sizes = walk_sizes<I>(geometry.in, in_divisors.of);
  for (I k = I(blockIdx.x) * kThreads + I(threadIdx.x); k < n; k += I(gridDim.x) * kThreads)
    grad_input[k] = T(pad_gradient_of<opmath_t<T>>(geometry, in_sizes, grad_output, k));
}

// Whether int32 holds every index of both sides, the mirror and repeat offsets pad_targets forms (up to three times
// an input dim's size), the amounts of a transposed geometry (at most a dim's size) and the grid-stride loop's last
// step past the end (a grid of at most 2^20 blocks of kTile elements: 2^30).
bool pad_fits_32_bits(const Tensor& a, const Tensor& b) {
  constexpr int64_t kMax32BitElements = int64_t(1) << 29;
  return a.numel() < kMax32BitElements && b.numel() < kMax32BitElements;
}

void pad_cuda(const Tensor& out, const Tensor& x, const PadGeometry& geometry, const Tensor& value) {
  cuda::DeviceGuard guard(out.device());
  cudaStream_t stream = cuda::current_stream(out.device());
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_all(out.dtype(), "pad", [&]<typename T>() {
    if (pad_fits_32_bits(out, x)) {
      pad_cuda_kernel<T, int32_t><<<blocks_for(n, kTile), kThreads, 0, stream>>>(
          out.data<T>(), x.data<T>(), geometry, divisors_of(geometry.out, geometry.dims), value.data<T>()[0],
          int32_t(n));
    } else {
      pad_cuda_kernel<T, int64_t><<<blocks_for(n, kTile), kThreads, 0, stream>>>(
          out.data<T>(), x.data<T>(), geometry, PadDivisors{}, value.data<T>()[0], n);
    }
    HG_CUDA_CHECK_LAUNCH("pad");
  });
}

void pad_backward_cuda(const Tensor& grad_input, const Tensor& grad_output, const PadGeometry& geometry) {
  cuda::DeviceGuard guard(grad_input.device());
  cudaStream_t stream = cuda::current_stream(grad_input.device());
  const int64_t n = grad_input.numel();
  if (n == 0) return;
  dispatch_floating(grad_input.dtype(), "pad_backward", [&]<typename T>() {
    if (pad_fits_32_bits(grad_input, grad_output)) {
      pad_backward_cuda_kernel<T, int32_t><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
          grad_input.data<T>(), grad_output.data<T>(), geometry, divisors_of(geometry.in, geometry.dims), int32_t(n));
    } else {
      pad_backward_cuda_kernel<T, int64_t><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
          grad_input.data<T>(), grad_output.data<T>(), geometry, PadDivisors{}, n);
    }
    HG_CUDA_CHECK_LAUNCH("pad_backward");
  });
}

}  // namespace

HG_REGISTER_KERNEL(pad_kernel, CUDA, pad_cuda);
HG_REGISTER_KERNEL(pad_backward_kernel, CUDA, pad_backward_cuda);

}  // namespace halfgrad
