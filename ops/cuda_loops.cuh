#pragma once
// CUDA loops over strided operands: the machinery behind every elementwise CUDA kernel (the GPU side of
// ops/loops.h).
//
//   launch_elementwise<Out, In...>("exp", out, functor, {in0, in1, ...});
//
// out and the inputs are viewed to one shape (broadcast inputs have stride 0); an input may instead be a
// 0-d CPU tensor, a scalar that is passed to the kernel by value. Two kernels:
//   - flat: out fills a range of memory without gaps (contiguous, channels last, any order of its dims) and every
//     tensor input has out's strides (and all are suitably aligned): element i of each is at the same place in
//     its range, so each thread loads and stores 16-byte vectors of the ranges, UNROLL of them in flight, no
//     index arithmetic;
//   - strided: dims are ordered by out's strides, innermost (smallest) first, so neighbouring threads touch
//     neighbouring addresses whatever the layout, and merged (ops/coalesce.h, as on the CPU); each element's byte
//     offsets are computed from its linear index with 32-bit division by precomputed magic numbers. Problems of
//     2^31 elements or more are split along their outermost dim into launches that fit.
// The functor is a plain struct with a __device__ operator()(In...) -> Out (not an extended lambda: those
// cannot be defined inside the generic lambdas of the dtype switch).

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <cuda/std/tuple>
#include <cuda/std/utility>
#include <vector>

#include "core/cuda.h"
#include "core/int_divider.h"
#include "core/tensor.h"
#include "ops/coalesce.h"

namespace halfgrad::cuda {

constexpr int kElementwiseBlock = 256;  // threads per block
constexpr int kElementwiseUnroll = 2;   // vectors (or elements) per thread in flight
constexpr int kMaxCoalescedDims = 12;   // after merging contiguous dims; more is an error

// Byte offsets of each operand for a linear element index (dims innermost first).
template <int N> struct OffsetCalculator {
  int ndim = 0;
  IntDivider sizes[kMaxCoalescedDims];
  int64_t strides[kMaxCoalescedDims][N];  // bytes

  __device__ __forceinline__ void get(uint32_t linear, int64_t (&offsets)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) offsets[k] = 0;
#pragma unroll
    for (int d = 0; d < kMaxCoalescedDims; ++d) {
      if (d == ndim) break;
      uint32_t q = sizes[d].div(linear);
      uint32_t r = linear - q * sizes[d].divisor;
      linear = q;
#pragma unroll
      for (int k = 0; k < N; ++k) offsets[k] += int64_t(r) * strides[d][k];
    }
  }
};

// An input operand as a kernel sees it: a pointer, or (ptr == nullptr) one value for every element.
template <typename T> struct InArg {
  const T* ptr;
  T value;
};

template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int VEC, typename T> __device__ __forceinline__ Vec<T, VEC> load_vec(const InArg<T>& a, int64_t i) {
  if (a.ptr == nullptr) {
    Vec<T, VEC> r;
#pragma unroll
    for (int k = 0; k < VEC; ++k) r.v[k] = a.value;
    return r;
  }
  return *reinterpret_cast<const Vec<T, VEC>*>(a.ptr + i);
}

template <typename T> __device__ __forceinline__ T load_at(const InArg<T>& a, int64_t byte_offset) {
  return a.ptr ? *reinterpret_cast<const T*>(reinterpret_cast<const char*>(a.ptr) + byte_offset) : a.value;
}

template <int VEC, typename F, typename Out, typename... In, size_t... K>
__device__ __forceinline__ void flat_body(int64_t n, const F& f, Out* out, const ::cuda::std::tuple<InArg<In>...>& in,
                                          ::cuda::std::index_sequence<K...>) {
  const int64_t first = int64_t(blockIdx.x) * kElementwiseUnroll * blockDim.x + threadIdx.x;  // in vectors
  // All loads of this thread first, then the math and the stores: UNROLL independent loads in flight.
  ::cuda::std::tuple<Vec<In, VEC>...> loaded[kElementwiseUnroll];
#pragma unroll
  for (int u = 0; u < kElementwiseUnroll; ++u) {
    int64_t i = (first + int64_t(u) * blockDim.x) * VEC;
    if (i + VEC <= n) loaded[u] = ::cuda::std::tuple<Vec<In, VEC>...>(load_vec<VEC>(::cuda::std::get<K>(in), i)...);
  }
#pragma unroll
  for (int u = 0; u < kElementwiseUnroll; ++u) {
    int64_t i = (first + int64_t(u) * blockDim.x) * VEC;
    if (i + VEC <= n) {
      Vec<Out, VEC> r;
#pragma unroll
      for (int k = 0; k < VEC; ++k) r.v[k] = f(::cuda::std::get<K>(loaded[u]).v[k]...);
      *reinterpret_cast<Vec<Out, VEC>*>(out + i) = r;
    } else if (i < n) {  // the last, partial vector
      for (int64_t j = i; j < n; ++j) out[j] = f(load_at(::cuda::std::get<K>(in), j * int64_t(sizeof(In)))...);
    }
  }
}

template <int VEC, typename F, typename Out, typename... In>
__global__ void __launch_bounds__(kElementwiseBlock)
    elementwise_flat_kernel(int64_t n, F f, Out* out, InArg<In>... in) {
  flat_body<VEC>(n, f, out, ::cuda::std::tuple<InArg<In>...>(in...), ::cuda::std::index_sequence_for<In...>{});
}

template <typename F, typename Out, typename... In, size_t... K>
__device__ __forceinline__ void strided_body(uint32_t n, const OffsetCalculator<1 + sizeof...(In)>& calc, const F& f,
                                             char* out, const ::cuda::std::tuple<InArg<In>...>& in,
                                             ::cuda::std::index_sequence<K...>) {
  const uint32_t first = blockIdx.x * kElementwiseUnroll * blockDim.x + threadIdx.x;
#pragma unroll
  for (int u = 0; u < kElementwiseUnroll; ++u) {
    uint32_t i = first + u * blockDim.x;
    if (i >= n) return;
    int64_t off[1 + sizeof...(In)];
    calc.get(i, off);
    *reinterpret_cast<Out*>(out + off[0]) = f(load_at(::cuda::std::get<K>(in), off[K + 1])...);
  }
}

template <typename F, typename Out, typename... In>
__global__ void __launch_bounds__(kElementwiseBlock)
    elementwise_strided_kernel(uint32_t n, OffsetCalculator<1 + sizeof...(In)> calc, F f, char* out,
                               InArg<In>... in) {
  strided_body<F, Out>(n, calc, f, out, ::cuda::std::tuple<InArg<In>...>(in...), ::cuda::std::index_sequence_for<In...>{});
}

// ---- host side

// An elementwise problem with its dims coalesced (ops/coalesce.h, innermost first) and each operand's base address.
// Operand 0 is the output; a scalar input has a null base and zero strides.
template <int N> struct StridedProblem : CoalescedDims<N> {
  std::array<char*, N> base{};
};

// Calls launch(sub) for pieces of `p` of fewer than 2^31 elements each, splitting the outermost dim.
template <int N, typename Launch> void for_each_32bit_piece(StridedProblem<N> p, const Launch& launch) {
  constexpr int64_t kMax = (int64_t(1) << 31) - 1;
  while (p.sizes.size() > 1 && p.sizes.back() == 1) {
    p.sizes.pop_back();
    p.byte_strides.pop_back();
  }
  if (p.numel() <= kMax) {
    launch(p);
    return;
  }
  const size_t d = p.sizes.size() - 1;
  const int64_t half = p.sizes[d] / 2;
  StridedProblem<N> second = p;
  p.sizes[d] = half;
  second.sizes[d] -= half;
  for (int k = 0; k < N; ++k)
    if (second.base[k]) second.base[k] += half * second.byte_strides[d][k];
  for_each_32bit_piece(p, launch);
  for_each_32bit_piece(second, launch);
}

// The kernels' offset calculator of a piece that for_each_32bit_piece gives (at most kMaxCoalescedDims dims).
template <int N> OffsetCalculator<N> offset_calculator(const StridedProblem<N>& p) {
  OffsetCalculator<N> calc;
  calc.ndim = int(p.sizes.size());
  for (int d = 0; d < calc.ndim; ++d) {
    calc.sizes[d] = IntDivider(uint32_t(p.sizes[size_t(d)]));
    for (int k = 0; k < N; ++k) calc.strides[d][k] = p.byte_strides[size_t(d)][size_t(k)];
  }
  return calc;
}

// Whether t's elements fill numel() consecutive slots from data_ptr() in some order of its dims (contiguous,
// channels last, a permutation of either): then an elementwise loop may walk that range instead of the indices.
inline bool fills_its_range(const Tensor& t) {
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.push_back(d);
  std::sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t expected = 1;
  for (int64_t d : dims) {
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// Whether a and b (of one shape) step the same way through memory (size-1 dims aside).
inline bool same_strides(const Tensor& a, const Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

template <typename T> InArg<T> make_in_arg(const Tensor& t) {
  if (t.is_cpu()) return InArg<T>{nullptr, *static_cast<const T*>(t.data_ptr())};  // a scalar by value
  return InArg<T>{static_cast<const T*>(t.data_ptr()), T()};
}

// out[i] = f(in0[i], in1[i], ...) with the storage types given. Inputs have out's shape, or are 0-d CPU
// scalars. Runs on out's device and current stream.
template <typename Out, typename... In, typename F>
void launch_elementwise(const char* op, const Tensor& out, F f, const std::array<Tensor, sizeof...(In)>& inputs) {
  constexpr int NIN = int(sizeof...(In));
  constexpr int N = 1 + NIN;
  const int64_t n = out.numel();
  HG_CHECK(out.is_cuda(), "{}: CUDA kernel given output {}", op, out.meta());
  for (const Tensor& t : inputs) {
    bool scalar = t.is_cpu() && t.dim() == 0;
    HG_CHECK(scalar || t.device() == out.device(), "{}: operands are on different devices: {} and {}", op,
             out.meta(), t.meta());
    HG_CHECK(scalar || t.shape() == out.shape(), "{}: operand {} does not have the output's shape {}", op, t.meta(),
             shape_str(out.shape()));
  }
  if (n == 0) return;
  DeviceGuard guard(out.device());
  cudaStream_t stream = current_stream(out.device());

  auto args = [&]<size_t... K>(std::index_sequence<K...>) {
    return ::cuda::std::tuple<InArg<In>...>(make_in_arg<In>(inputs[K])...);
  }(std::index_sequence_for<In...>{});

  // Flat fast path: 16-byte vectors of the widest operand type.
  constexpr size_t widest = std::max({sizeof(Out), sizeof(In)...});
  constexpr int VEC = int(16 / widest) > 0 ? int(16 / widest) : 1;
  bool flat = fills_its_range(out) && reinterpret_cast<uintptr_t>(out.data_ptr()) % (VEC * sizeof(Out)) == 0;
  {
    constexpr size_t in_sizes[NIN + 1] = {sizeof(In)..., 0};
    for (int k = 0; k < NIN && flat; ++k) {
      const Tensor& t = inputs[size_t(k)];
      if (t.is_cpu()) continue;  // a scalar
      flat = same_strides(t, out) && reinterpret_cast<uintptr_t>(t.data_ptr()) % (VEC * in_sizes[k]) == 0;
    }
  }
  if (flat) {
    int64_t vectors = (n + VEC - 1) / VEC;
    int64_t blocks = (vectors + int64_t(kElementwiseBlock) * kElementwiseUnroll - 1) /
                     (int64_t(kElementwiseBlock) * kElementwiseUnroll);
    [&]<size_t... K>(std::index_sequence<K...>) {
      elementwise_flat_kernel<VEC, F, Out, In...><<<unsigned(blocks), kElementwiseBlock, 0, stream>>>(
          n, f, static_cast<Out*>(out.data_ptr()), ::cuda::std::get<K>(args)...);
    }(std::index_sequence_for<In...>{});
    HG_CUDA_CHECK_LAUNCH(op);
    return;
  }

  std::array<const Shape*, N> strides{};
  std::array<char*, N> base{};
  const std::array<int64_t, N> element_sizes{int64_t(sizeof(Out)), int64_t(sizeof(In))...};
  strides[0] = &out.strides();
  base[0] = static_cast<char*>(out.data_ptr());
  for (int k = 0; k < NIN; ++k) {
    const Tensor& t = inputs[size_t(k)];
    if (t.is_cpu()) continue;  // a scalar: no strides, no base
    strides[size_t(k + 1)] = &t.strides();
    base[size_t(k + 1)] = static_cast<char*>(t.data_ptr());
  }
  const StridedProblem<N> problem{coalesce_dims<N>(out.shape(), strides, element_sizes), base};
  HG_CHECK(int(problem.sizes.size()) <= kMaxCoalescedDims,
           "{}: {} has {} dims that cannot be merged; the CUDA kernels handle up to {}", op, out.meta(),
           problem.sizes.size(), kMaxCoalescedDims);
  for_each_32bit_piece<N>(problem, [&](const StridedProblem<N>& p) {
    const OffsetCalculator<N> calc = offset_calculator(p);
    const uint32_t count = uint32_t(p.numel());
    const uint32_t blocks = (count + kElementwiseBlock * kElementwiseUnroll - 1) / (kElementwiseBlock * kElementwiseUnroll);
    [&]<size_t... K>(std::index_sequence<K...>) {
      // The scalar operands keep their value; the others point at this piece's base.
      auto piece_arg = [&](auto arg, size_t k) {
        if (arg.ptr) arg.ptr = reinterpret_cast<decltype(arg.ptr)>(p.base[k + 1]);
        return arg;
      };
      elementwise_strided_kernel<F, Out, In...><<<blocks, kElementwiseBlock, 0, stream>>>(
          count, calc, f, p.base[0], piece_arg(::cuda::std::get<K>(args), K)...);
    }(std::index_sequence_for<In...>{});
    HG_CUDA_CHECK_LAUNCH(op);
  });
}

}  // namespace halfgrad::cuda
