#pragma once
// Reductions: sum, mean, var, std, max/min (with indices), amax/amin, argmax/argmin, all/any.
//
// Path from the public op to the kernel (ops/reduce.cpp):
//   Tensor::sum / halfgrad::sum  ->  run_reduction()  ->  reduce_kernel[device](ReduceArgs)
//                                                             CPU: reduce_cpu (ops/reduce.cpp)
//                                                             CUDA: reduce_cuda (ops/reduce.cu)
// The op layer does all the shape work (dims, keepdim, dtype rules, autograd); a kernel only ever sees
// a contiguous input laid out as [outer, reduced, inner] and writes [outer, inner] outputs.
#include <cstdint>
#include <utility>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// ---- public ops (the Tensor methods of the same names call these). Empty `dims` means every dim;
// negative dims count from the end; a dim given twice is an error.

// Sum; bool and integer inputs give int64, floating inputs keep their dtype (accumulating in float32 for
// float16/bfloat16/float32, in float64 for float64). Sum of an empty tensor is 0.
Tensor sum(const Tensor& x, Dims dims = {}, bool keepdim = false);
// Mean (floating inputs only). Mean of an empty tensor is nan.
Tensor mean(const Tensor& x, Dims dims = {}, bool keepdim = false);
// Variance with `correction` subtracted from the count (1: Bessel's unbiased estimate, 0: population).
Tensor var(const Tensor& x, Dims dims = {}, int64_t correction = 1, bool keepdim = false);
// Standard deviation: the square root of var (the same correction); its gradient where it is 0 is 0, as PyTorch's.
Tensor std(const Tensor& x, Dims dims = {}, int64_t correction = 1, bool keepdim = false);
// Over all elements; nan if any element is nan. Empty input is an error.
Tensor max(const Tensor& x);
Tensor min(const Tensor& x);
// The largest / smallest values over dims (every dim where empty), nan if any of them is nan; a reduced dim of size 0
// is an error. Gradient: split evenly among the elements equal to their result, as PyTorch's amax / amin (a nan
// result, which no element equals, gives its group nan, as PyTorch's; max() gives it to the nans).
Tensor amax(const Tensor& x, Dims dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, Dims dims = {}, bool keepdim = false);
// Along one dim: (values, int64 indices of the first occurrence; a nan wins and its first index is taken).
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
// Whether all / any elements are nonzero (nan counts as nonzero); bool result (uint8 for a uint8 input, as PyTorch).
// all of nothing is true.
Tensor all(const Tensor& x, Dims dims = {}, bool keepdim = false);
Tensor any(const Tensor& x, Dims dims = {}, bool keepdim = false);

// ---- kernel interface, shared by the CPU kernel and the CUDA one

enum class ReduceOp : uint8_t { Sum, Mean, Var, Max, Min, ArgMax, ArgMin, All, Any };
const char* reduce_op_name(ReduceOp op);

// One reduction for a kernel to run. Output element (o, i) reduces input[o, 0..reduced, i].
//
// Dtypes (the op layer allocates the outputs):
//   input    any dtype the op accepts (Mean/Var: floating only)
//   values   Sum: int64 for bool/integer input, else the input dtype; Mean/Var/Max/Min: the input dtype;
//            All/Any: bool; ArgMax/ArgMin: undefined (not computed)
//   indices  int64, defined for Max/Min along a dim and for ArgMax/ArgMin; undefined otherwise
// Accumulation: float32 for float16/bfloat16/float32, float64 for float64, int64 for integers.
// reduced == 0 is allowed for ops with an identity (Sum 0, Mean nan, Var nan, All true, Any false);
// the op layer rejects it for Max/Min/ArgMax/ArgMin.
struct ReduceArgs {
  ReduceOp op;
  Tensor input;    // (outer, reduced, inner), contiguous
  Tensor values;   // (outer, inner), contiguous, or undefined
  Tensor indices;  // (outer, inner), contiguous int64, or undefined
  int64_t outer = 1, reduced = 1, inner = 1;
  int64_t correction = 0;  // Var: the divisor is max(0, reduced - correction)
};

using ReduceKernel = void (*)(const ReduceArgs& args);
extern KernelTable<ReduceKernel> reduce_kernel;

}  // namespace halfgrad
