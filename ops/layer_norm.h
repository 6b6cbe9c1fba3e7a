#pragma once
// layer_norm: normalises each sample over its last dims (torch.nn.functional.layer_norm).
//
// Path from the public op to the kernels (ops/layer_norm.cpp):
//   layer_norm  ->  checks, input made contiguous and seen as [rows, cols] (cols: the product of normalized_shape)
//               ->  layer_norm_forward_kernel[device]      CPU: ops/layer_norm.cpp, CUDA: ops/layer_norm.cu
//   backward    ->  layer_norm_backward_kernel[device]
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// ---- the op. Autocast category: "float32", as PyTorch's (under autocast a float16 input, and float16 parameters,
// are computed and returned in float32).
//
// input [..., *normalized_shape] (any floating dtype); weight, bias: normalized_shape, of input's dtype and device,
// or undefined (no elementwise affine); float32 parameters beside a float16 input are refused, as by PyTorch's CUDA
// kernel (autocast casts all to float32). Each row, the last normalized_shape.size() dims of one sample, is normalised
// with its own mean and biased variance:
//   y = (x - mean) / sqrt(var + eps) * weight + bias      (weight 1 and bias 0 where undefined)
// The statistics are kept in float32 for float16/bfloat16/float32 (float64 for float64) and computed in two passes
// over the row (mean, then the squared deviations from it: no cancellation where the mean is large against the
// spread), summed in that dtype on CUDA and in double on the CPU; y has the input's dtype, contiguous. Gradients:
// input, weight and bias. normalized_shape must not be empty and must end the input's shape; eps > 0 is not required
// (PyTorch's neither), eps >= 0 is.
Tensor layer_norm(const Tensor& input, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// ---- the normalisation's rules in ops that record: layer_norm's and batch_norm's backward in a pass with create_graph
// (their kernels otherwise), over `dims` of x (the accumulation dtype).
// x^ = (x - mean) invstd, invstd = 1 / sqrt(var + eps), the statistics over dims (the biased variance).
struct Normalization {
  Tensor normalized, invstd;  // invstd keeps dims as size 1
};
Normalization normalization_recorded(const Tensor& x, const Dims& dims, double eps);
// The gradient by x, with gw the gradient by x^: invstd (gw - mean(gw) - x^ mean(gw x^)), the means over dims.
Tensor normalization_input_gradient(const Tensor& gw, const Normalization& n, const Dims& dims);

// ---- kernels, for rows, cols > 0. Every per-element tensor is contiguous [rows, cols] of dtype T; weight, bias
// [cols] of T or undefined; mean and rstd [rows] of the accumulation dtype A (float32, or float64 for float64 input).
struct LayerNormShape {
  int64_t rows, cols;
};

// Writes output, and mean and rstd = 1 / sqrt(var + eps) of each row, which the backward reads.
struct LayerNormForwardArgs {
  LayerNormShape shape;
  Tensor input, weight, bias, output, mean, rstd;
  double eps;
};

// With xhat = (x - mean) * rstd, g the output's gradient and gw = g * weight (g where weight is undefined), per row:
//   grad_input  = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))
// and over the rows: grad_weight = sum(g * xhat), grad_bias = sum(g). An undefined grad_* is not wanted.
struct LayerNormBackwardArgs {
  LayerNormShape shape;
  Tensor grad_output, input, weight, mean, rstd;
  Tensor grad_input, grad_weight, grad_bias;
};

using LayerNormForwardKernel = void (*)(const LayerNormForwardArgs& args);
using LayerNormBackwardKernel = void (*)(const LayerNormBackwardArgs& args);
extern KernelTable<LayerNormForwardKernel> layer_norm_forward_kernel;
extern KernelTable<LayerNormBackwardKernel> layer_norm_backward_kernel;

}  // namespace halfgrad
