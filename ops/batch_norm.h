#pragma once
// batch_norm: normalises each channel of an [N, C, ...] input over the batch and spatial dims.
//
// Path from the public op to the kernels (ops/batch_norm.cpp):
//   batch_norm, batch_norm_relu  ->  checks, input seen as [N, C, S] in one of two memory layouts, parameters
//                   in the accumulation dtype  ->  batch_norm_forward_kernel[device]
//   backward    ->  batch_norm_backward_kernel[device]; in a pass with create_graph, ops that record (their formulas)
// CPU kernels: ops/batch_norm.cpp; CUDA kernels: ops/batch_norm.cu, our own for both layouts, and cuDNN's as a
// second implementation of training (BatchNormBackend below).
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// ---- the op (torch.nn.functional.batch_norm). Autocast category: "unchanged": it takes float16/bfloat16
// activations with float32 parameters and statistics itself (apex O2's "BatchNorm in FP32").
//
// input [N, C, ...] (any floating dtype); running_mean, running_var, weight, bias: [C] or undefined.
//   training: each channel is normalised with the mean and the biased variance of its N * S values
//             (S = the product of the dims after C), and, when defined, the running statistics are
//             updated in place: running = (1 - momentum) * running + momentum * batch statistic, with the
//             unbiased variance (N * S / (N * S - 1) times the biased one). Needs N * S > 1.
//   eval:     each channel is normalised with running_mean and running_var (both required).
//   y = (x - mean) / sqrt(var + eps) * weight + bias    (weight 1 and bias 0 where undefined)
// The result has the input's dtype and memory layout (a channels_last input gives a channels_last result).
// Statistics are computed in float32 for float16/bfloat16/float32 inputs (float64 for float64), whatever
// the dtype of the parameters, which may differ from the input's (float16 input with float32 weight, bias
// and running statistics is the usual mixed-precision case). Gradients: input, weight and bias, in both
// modes (eval: the statistics are constants).
//
// input_bias: [C] or undefined. Normalises input + input_bias (added to every value of its channel) without forming
// the sum: a convolution's bias before batch norm (nn::Sequential passes it so, VGG's conv -> bn -> relu).
//   training: the batch mean takes the shift and the variance does not, so y is the same as without it; the running
//             mean is updated with mean(input) + input_bias. The gradient of input_bias is the sum over each
//             channel of the input's gradient, which with batch statistics is zero (the sum of
//             weight * invstd * (g - mean(g) - xhat * mean(g * xhat)) over a channel is -weight * invstd *
//             mean(g * xhat) * sum(xhat), and sum(xhat) = 0): it is returned as zeros, where the separate ops
//             return the rounding error of that sum. Skipped: the bias's add forward (a pass reading and writing
//             the activation) and the sum of its gradient backward (a pass reading it); added: three launches
//             on [C] vectors (the running mean's add, its cast, the zeros). What a user sees differ: the bias
//             and its optimizer state stay where weight decay and momentum alone take them, where in PyTorch
//             an optimizer that scales a gradient by its own size (Adam, RMSprop) moves the bias by up to lr a
//             step on that rounding error. Neither changes the output in training.
//   eval:     the sum is formed (an add in the input's dtype) and normalised. nn::Sequential folds only where
//             the batch norm uses batch statistics, so there the convolution adds its own bias.
// set_batch_norm_input_bias_fold(false): the sum is formed in training too.
//
// num_batches_tracked: int64 with one element on the input's device, or undefined. training: one is added to it, as
// nn::BatchNorm2d counts its batches, by the forward's own kernels where they can (on CUDA our statistics kernel; a
// layer's separate add was one more launch, 20 of a ResNet-18 step's ~325 graph nodes). eval: left alone.
Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5,
                  const Tensor& input_bias = Tensor(), const Tensor& num_batches_tracked = Tensor());

// ---- batch_norm with what follows it in a ResNet or VGG block, in one op (the fusion torch.compile makes):
//   y = relu(batch_norm(input, ...) + residual)        residual undefined: y = relu(batch_norm(input, ...))
// The same arguments, statistics and counting as batch_norm. residual: input's shape, on its device; it is read in
// input's dtype (cast when it differs) and y has input's dtype and layout. Autocast category: as batch_norm's.
// Why one op: apart, the normalised values are written, read back by the add, written, read by relu and written
// again; here the kernel that normalises adds and clamps as it writes. The backward reads relu's mask (y > 0) inside
// the normalisation's own passes instead of a pass of its own. Gradients: as batch_norm's, and residual's, which is
// relu's gradient (g where y > 0, else 0).
// saved: what the backward keeps to know where y > 0 (ReluSaved below).
// In float32 and float64 y equals the separate ops' result exactly where both run the same kernels (on CUDA the
// implementation timed fastest may differ between the two forms: BatchNormBackend). In float16/bfloat16 our kernels
// round y once instead of after each op; after cuDNN's kernels, whose output is rounded, the residual is added to it
// and rounded again, as the separate ops do.
// input_bias: as batch_norm's.
//   Mask    relu's mask as bits beside y, written by the forward: 1/16 of a float16 y's bytes, read by the backward
//           where y would cost 16 or 32 bits an element. The smaller to keep where nothing else keeps y for its own
//           backward: before max pooling (which keeps window positions) or global average pooling. An in-place
//           change to y before backward does not change the gradients.
//   Output  y itself, which costs no memory where the next op keeps y anyway: a convolution keeps its input for its
//           weight's gradient (models/resnet.h: inside a ResNet and between its blocks). The forward stores no bits;
//           on CUDA our backward makes them from y in a pass of its own (the masked gradient before cuDNN's reads y
//           itself): one more read of y than Mask, the price of the memory (ResNet-50 amp at batch 256, its blocks
//           on Output but the last: 3,476 -> 3,384 MiB at the peak, ~2-3.6% more time a step). An in-place change
//           to y before backward is an error, as for any kept tensor. Where cuDNN's fused kernels run the layer
//           with a residual (BatchNormBackend below), their forward keeps relu's mask in cuDNN's own form for their
//           backward, about the bytes of Mask's (without a residual they need none).
// With the fusion off (set_batch_norm_relu_fusion(false)) the separate relu keeps y whatever `saved` says.
enum class ReluSaved { Mask, Output };
Tensor batch_norm_relu(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                       double eps = 1e-5, const Tensor& residual = Tensor(), const Tensor& input_bias = Tensor(),
                       ReluSaved saved = ReluSaved::Mask, const Tensor& num_batches_tracked = Tensor());
// Off: batch_norm_relu runs the separate ops (batch_norm, add, relu) instead, for the whole process (default on):
// to measure what the fusion saves (bench_train_step --unfused) or to rule it out.
void set_batch_norm_relu_fusion(bool enabled);
bool batch_norm_relu_fusion();
// Off: batch_norm's input_bias is added to the input as a separate op in training too, for the whole process
// (default on): to measure what the fold saves (bench_train_step --no-bias-fold) or to rule it out.
void set_batch_norm_input_bias_fold(bool enabled);
bool batch_norm_input_bias_fold();

// ---- kernels
//
// The input is seen as [N, C, S] in one of two layouts:
//   planes        (NCHW contiguous):             element (n, c, s) at (n * C + c) * S + s
//   channels last (NHWC, and every [N, C] input): element (n, c, s) at (n * S + s) * C + c
// Every per-element tensor of one call (input, output, residual, grad_output, grad_input, grad_residual) has the same
// layout and dtype T; every per-channel tensor is [C], contiguous, in the accumulation dtype A (float32, or float64
// when T is float64).
// An uninitialised per-element tensor of `shape` ([N, C, ...]) in one of those layouts (channels_last: C innermost).
Tensor batch_norm_empty(const Shape& shape, DType dtype, Device device, bool channels_last);

struct BatchNormShape {
  int64_t batch = 1, channels = 1, spatial = 1;
  bool channels_last = false;
  int64_t per_channel() const { return batch * spatial; }  // values that each channel's statistics cover
};

// batch_norm_relu's mask: bit i % 32 of 32-bit word i / 32 is set where element i of the output (its offset in the
// layout above) is positive; int32 [ceil(N C S / 32)], the bits past the last element 0.
struct ReluMask {
  static int64_t words(int64_t elements) { return (elements + 31) / 32; }
  HG_HOST_DEVICE static bool bit(const int32_t* mask, int64_t i) { return (uint32_t(mask[i / 32]) >> (i % 32)) & 1u; }
};
// passes (bool, of the output's shape and layout) = the mask's bits, element i (its offset in the layout) bit i: where
// relu let the gradient through, for batch_norm_relu's backward in a pass with create_graph (in ops that record).
using ReluMaskValuesKernel = void (*)(const Tensor& passes, const Tensor& mask);
extern KernelTable<ReluMaskValuesKernel> relu_mask_values_kernel;

// Whether cuDNN's fused batch norm + relu kernel ran a forward (section 4 of ops/batch_norm.cu), and its reserve:
// relu's mask in cuDNN's own form (undefined where cuDNN asks for none), which only cuDNN's fused backward reads.
struct CudnnFused {
  bool ran = false;
  Tensor reserve;
};

struct BatchNormForwardArgs {
  BatchNormShape shape;
  Tensor input, output;
  Tensor weight, bias;                 // or undefined
  Tensor running_mean, running_var;    // or undefined; updated in place when training
  Tensor batches_tracked;              // or undefined; int64, one element: one added when training
  Tensor save_mean, save_invstd;       // written: the mean and 1 / sqrt(var + eps) used to normalise
  bool relu = false;                   // batch_norm_relu: output = relu(normalised + residual)
  Tensor residual;                     // or undefined; the input's layout and dtype
  Tensor relu_mask;                    // or undefined; with relu: written, the output's signs as bits (ReluMask)
  bool training = true;
  double momentum = 0.1, eps = 1e-5;
  // Written by the kernel (mutable: which kernel runs is the kernel's choice, so the caller cannot prepare it).
  mutable CudnnFused cudnn_fused;
};

// With mean and invstd as saved by the forward, M = N * S and g the gradient of the output:
//   grad_bias   = sum(g)                       grad_weight = sum(g * (x - mean)) * invstd
//   grad_input  = weight * invstd * (g - sum(g) / M - (x - mean) * invstd^2 * sum(g * (x - mean)) / M)
//                 in training; weight * invstd * g in eval (the statistics did not depend on x).
// After batch_norm_relu, g above is the gradient that passes relu, where(output > 0, grad_output, 0), which is
// also the residual's gradient. The kernels read where output > 0 from relu_mask, or from output when that is given
// instead (ReluSaved::Output).
struct BatchNormBackwardArgs {
  BatchNormShape shape;
  Tensor grad_output, input;
  Tensor relu_mask;                    // batch_norm_relu's mask (ReluMask), which masks grad_output; or undefined
  Tensor output;                       // batch_norm_relu's output, in place of relu_mask; or undefined
  Tensor grad_residual;                // or undefined: not wanted (only after batch_norm_relu)
  Tensor weight;                       // or undefined
  Tensor save_mean, save_invstd;
  Tensor grad_input;                   // or undefined: not wanted
  Tensor grad_weight, grad_bias;       // or undefined: not wanted
  bool training = true;
  double eps = 1e-5;                   // the forward's (cuDNN's backward takes it; save_invstd already has it)
  CudnnFused cudnn_fused;              // the forward's: cuDNN's fused backward runs where its forward ran
  bool residual_added = false;         // the forward added a residual (cuDNN's fused backward repeats its operation)
  Tensor bias;                         // or undefined; cuDNN's fused backward reads it
  bool after_relu() const { return relu_mask.defined() || output.defined(); }  // batch_norm_relu's backward
};

// ---- which CUDA implementation runs training (set for the whole process; default Auto). cuDNN's kernels, the
// ones PyTorch calls, keep a block's share of the activation on chip between the statistics and the
// normalisation; they are faster than ours on the smaller shapes and slower on the larger.
//   Auto   the first time a host thread meets a problem (device, dtype, layout, direction, batch_norm_relu's
//          epilogue and whether it keeps the mask or y, N, C, spatial size) that both take, both run on its buffers
//          and the faster is kept for it, as conv2d keeps its fastest algorithm. A float16 channels-last
//          batch_norm_relu that keeps y (ReluSaved::Output) may run cuDNN's fused kernels, batch norm, residual add
//          and relu in one kernel a direction, whose backward needs its forward's reserve: there the two
//          directions are timed and chosen together, ours (with the backward's own choice) against cuDNN's pair.
//   Own    always ours
//   Cudnn  cuDNN's wherever it takes the problem: float16/float32, spatial size > 1, contiguous runs (channels in
//          channels last, planes in NCHW) of whole 16-byte vectors, 16-byte aligned data, fewer than 2^31
//          elements; the backward also needs the input's gradient. Everything else runs ours in every mode.
//          Its fused kernels wherever they take batch_norm_relu (above); elsewhere its batch norm alone, with relu
//          and the residual as passes of ours.
enum class BatchNormBackend { Auto, Own, Cudnn };
void set_batch_norm_backend(BatchNormBackend backend);
BatchNormBackend batch_norm_backend();

using BatchNormForwardKernel = void (*)(const BatchNormForwardArgs& args);
using BatchNormBackwardKernel = void (*)(const BatchNormBackwardArgs& args);
extern KernelTable<BatchNormForwardKernel> batch_norm_forward_kernel;
extern KernelTable<BatchNormBackwardKernel> batch_norm_backward_kernel;

}  // namespace halfgrad
