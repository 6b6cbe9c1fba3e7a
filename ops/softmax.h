#pragma once
// softmax and log_softmax along one dim.
//
// Path from the public op to the kernel (ops/softmax.cpp):
//   softmax / log_softmax  ->  input made contiguous, seen as [outer, size, inner] (size: the softmax dim)
//                          ->  softmax_kernel[device]           CPU: ops/softmax.cpp, CUDA: ops/softmax.cu
//   backward               ->  softmax_backward_kernel[device]
// Numerically stable: the row maximum is subtracted before exponentiating; float16/bfloat16 rows are
// accumulated in float32 and rounded once.
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// ---- public ops. Autocast category: "float32" (under autocast a float16 input is computed, and returned,
// in float32). Without autocast the result has the input's dtype. Floating inputs only. A 0-d input is a
// row of one element (dim 0 or -1).
//   softmax(x)_i     = exp(x_i - max x) / sum_j exp(x_j - max x)
//   log_softmax(x)_i = x_i - max x - log(sum_j exp(x_j - max x))
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// ---- kernels. `in`, `out`, `grad_*` are contiguous, of one floating dtype, viewed as [outer, size, inner]:
// the softmax runs over the middle dim, for each (outer, inner) pair. size >= 1.
struct SoftmaxShape {
  int64_t outer = 1, size = 1, inner = 1;
};
// out = softmax(in) or log_softmax(in) (log = true).
using SoftmaxKernel = void (*)(const Tensor& out, const Tensor& in, SoftmaxShape shape, bool log);
// From the forward output y and the incoming gradient g:
//   softmax:     grad_in = y * (g - sum(g * y))
//   log_softmax: grad_in = g - exp(y) * sum(g)
using SoftmaxBackwardKernel = void (*)(const Tensor& grad_in, const Tensor& grad_out, const Tensor& out,
                                       SoftmaxShape shape, bool log);
extern KernelTable<SoftmaxKernel> softmax_kernel;
extern KernelTable<SoftmaxBackwardKernel> softmax_backward_kernel;

}  // namespace halfgrad
