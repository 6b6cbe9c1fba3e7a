// Binary elementwise ops on CUDA (add, mul, comparisons, ...): the kernel behind binary_kernel. In its own
// file, apart from ops/elementwise.cu, because it holds most of the elementwise instantiations (15 ops x 8
// dtypes, and 3 more on the 4 floating ones): two files compile in parallel. Arithmetic: ops/elementwise_math.h;
// loops: ops/cuda_loops.cuh.
// elementwise_math.h compares with zero generically, which is pointless (and harmless) for unsigned types.
#pragma nv_diag_suppress 186

#include <type_traits>

#include "ops/cuda_loops.cuh"
#include "ops/elementwise.h"

namespace halfgrad {
namespace {

// What an op stores: bool for comparisons and logical ops, else the operands' dtype.
template <BinaryOp OP, typename T> using BinaryResult = std::conditional_t<is_predicate(OP), bool, T>;

// Load in the storage type, compute in opmath_t (float for float16/bfloat16), store.
template <BinaryOp OP, typename T> struct BinaryFn {
  __device__ BinaryResult<OP, T> operator()(T a, T b) const {
    return BinaryResult<OP, T>(binary_math<OP>(opmath_t<T>(a), opmath_t<T>(b)));
  }
};
// The (op, dtype) pairs the op layer (ops/elementwise.cpp) can send, by the op's row in ops/elementwise_math.h:
// bool takes only the ops that allow it, integer or bool division is true division (computed in float) and the
// activations' derivatives take floating operands alone. Kernels are instantiated for these pairs only.
template <BinaryOp OP, typename T> constexpr bool binary_supported() {
  if constexpr (std::is_same_v<T, bool>) return takes_bool(OP) && !needs_floating(OP);
  else if constexpr (std::is_integral_v<T>) return !needs_floating(OP) && !floating_only(OP);
  else return true;
}

// Float16 or bfloat16 arithmetic with a number, read in float32 (its opmath type), on either side.
template <BinaryOp OP, typename T> struct BinaryScalarFn {
  float scalar;
  bool scalar_left;
  __device__ BinaryResult<OP, T> operator()(T x) const {
    return BinaryResult<OP, T>(scalar_left ? binary_math<OP>(scalar, float(x)) : binary_math<OP>(float(x), scalar));
  }
};

template <typename T>
void binary_scalar_cuda(BinaryOp op, const Tensor& out, const Tensor& x, float scalar, bool left) {
  const char* name = op_name(op);
  dispatch_binary_op(op, [&]<BinaryOp OP>() {
    cuda::launch_elementwise<BinaryResult<OP, T>, T>(name, out, BinaryScalarFn<OP, T>{scalar, left}, {x});
  });
}

// a or b may be a 0-d CPU tensor: launch_elementwise passes it to the kernel by value. In float16 and bfloat16
// arithmetic it is float32 (binary_kernel's contract), and goes into the functor instead.
void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* name = op_name(op);
  if (a.dtype() != b.dtype())
    return dispatch_float32_number(op, a, b, [&]<typename T>(const Tensor& x, float number, bool left) {
      binary_scalar_cuda<T>(op, out, x, number, left);
    });
  dispatch_all(a.dtype(), name, [&]<typename T>() {
    dispatch_binary_op(op, [&]<BinaryOp OP>() {
      if constexpr (!binary_supported<OP, T>()) {
        HG_FAIL("{}: no CUDA kernel for {} operands", name, a.meta());
      } else {
        cuda::launch_elementwise<BinaryResult<OP, T>, T, T>(name, out, BinaryFn<OP, T>{}, {a, b});
      }
    });
  });
}

}  // namespace

HG_REGISTER_KERNEL(binary_kernel, CUDA, binary_cuda);

}  // namespace halfgrad
