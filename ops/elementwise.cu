// Elementwise ops on CUDA: the unary, where and fill kernels (binary ops: ops/elementwise_binary.cu, a
// separate file so that nvcc compiles the two halves in parallel). The arithmetic is ops/elementwise_math.h,
// the same functions the CPU kernels use; the loops are ops/cuda_loops.cuh.
// elementwise_math.h compares with zero generically, which is pointless (and harmless) for unsigned types.
#pragma nv_diag_suppress 186

#include <type_traits>

#include "ops/cuda_loops.cuh"
#include "ops/elementwise.h"

namespace halfgrad {
namespace {

// ---- functors: load in the storage type, compute in opmath_t (float for float16/bfloat16), store

template <UnaryOp OP, typename T> struct UnaryFn {
  __device__ T operator()(T x) const { return T(unary_math<OP>(opmath_t<T>(x))); }
};
template <UnaryOp OP, typename T> struct UnaryPredicateFn {
  __device__ bool operator()(T x) const { return bool(unary_math<OP>(opmath_t<T>(x))); }
};
template <typename T> struct WhereFn {
  __device__ T operator()(bool c, T a, T b) const { return c ? a : b; }
};
template <typename T> struct FillFn {
  T value;
  __device__ T operator()() const { return value; }
};

// The (op, dtype) pairs the op layer (ops/elementwise.cpp) can send, by the op's row in ops/elementwise_math.h:
// math functions get floating inputs (integers and bool are cast to float32 first), the floating-only ones (gelu,
// silu) floating inputs alone, bool only the others that take it.
// Kernels are instantiated for these pairs only, which keeps nvcc's work down.
template <UnaryOp OP, typename T> constexpr bool unary_supported() {
  if constexpr (std::is_same_v<T, bool>) return takes_bool(OP) && !needs_floating(OP);
  else if constexpr (std::is_integral_v<T>) return !needs_floating(OP) && !floating_only(OP);
  else return true;
}

void unary_cuda(UnaryOp op, const Tensor& out, const Tensor& in) {
  const char* name = op_name(op);
  dispatch_all(in.dtype(), name, [&]<typename T>() {
    dispatch_unary_op(op, [&]<UnaryOp OP>() {
      if constexpr (!unary_supported<OP, T>()) {
        HG_FAIL("{}: no CUDA kernel for {} input", name, in.meta());
      } else if constexpr (is_predicate(OP)) {
        cuda::launch_elementwise<bool, T>(name, out, UnaryPredicateFn<OP, T>{}, {in});
      } else {
        cuda::launch_elementwise<T, T>(name, out, UnaryFn<OP, T>{}, {in});
      }
    });
  });
}

void where_cuda(const Tensor& out, const Tensor& condition, const Tensor& a, const Tensor& b) {
  HG_CHECK(condition.dtype() == kBool && a.dtype() == out.dtype() && b.dtype() == out.dtype(),
           "where: CUDA kernel given condition {}, a {}, b {} for output {}", condition.meta(), a.meta(), b.meta(),
           out.meta());
  dispatch_all(out.dtype(), "where", [&]<typename T>() {
    cuda::launch_elementwise<T, bool, T, T>("where", out, WhereFn<T>{}, {condition, a, b});
  });
}

void fill_cuda(const Tensor& out, const Scalar& value) {
  dispatch_all(out.dtype(), "fill_", [&]<typename T>() {
    const T v = fill_value<T>(value);
    cuda::launch_elementwise<T>("fill_", out, FillFn<T>{v}, {});
  });
}

}  // namespace

HG_REGISTER_KERNEL(unary_kernel, CUDA, unary_cuda);
HG_REGISTER_KERNEL(where_kernel, CUDA, where_cuda);
HG_REGISTER_KERNEL(fill_kernel, CUDA, fill_cuda);

}  // namespace halfgrad
