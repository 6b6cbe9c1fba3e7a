#pragma once
// Loss functions. Each takes a Reduction, as torch.nn.functional's losses do.
//
//   mse_loss                           (input, target, reduction)
//   nll_loss                           (log_probs, class indices, {weight, ignore_index, reduction})
//   cross_entropy                      (logits, class indices or probabilities,
//                                       {weight, ignore_index, label_smoothing, reduction})
//   binary_cross_entropy               (probabilities, target, {weight, reduction}): refused under autocast
//   binary_cross_entropy_with_logits   (logits, target, {weight, pos_weight, reduction})
//
// Options are aggregates, so a call names what it changes (every member has a default member initializer,
// `{}` for tensors, so GCC 12's -Wmissing-field-initializers stays quiet about the ones left out):
//   cross_entropy(logits, labels, {.ignore_index = 0, .label_smoothing = 0.1});
//   nll_loss(log_probs, labels, {.weight = class_weights, .reduction = Reduction::Sum});
// Forward and backward: ops/loss.cpp (nll_loss's gather/scatter kernels and cross_entropy's one-pass kernels there
// and in ops/loss.cu; the other losses are written with tensor ops and run on any device).
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

// What a loss does with its per-element values: keep them (None), average them (Mean), add them (Sum).
enum class Reduction { None, Mean, Sum };
const char* reduction_name(Reduction reduction);

// Mean squared error: (input - target)^2, reduced. input and target must have the same shape (PyTorch
// broadcasts with a warning, which hides a wrong target shape: [N] against [N, 1] gives an [N, N] loss;
// here it is an error). Differentiable in both input and target. Autocast category: "float32".
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

// ---- nll_loss and cross_entropy. Autocast category: "float32" (nll_loss), "float32 math" (cross_entropy: float16
// logits are read as they are and the loss is float32, without a float32 copy of the logits).
//
// Shapes (C classes): input [N, C] with target [N]; input [N, C, d1, ..., dk] with target [N, d1, ..., dk]
// (per-pixel classification); input [C] with a 0-d target (one sample). Targets are class indices (int64;
// other integer dtypes are converted) in [0, C), or ignore_index. An out-of-range target is an error that
// names it (on CUDA a device-side assertion: the message is printed by the kernel and the CUDA context is
// lost, as in PyTorch; run on the CPU, or with HALFGRAD_CUDA_LAUNCH_BLOCKING=1, to find it).
//
// With per-class weights w (a [C] tensor; none means all ones), element j with target t_j has
//   loss_j = -w[t_j] * input[j, t_j]        (0 where t_j == ignore_index)
// and the reductions are None: the [N, d...] losses; Sum: their sum; Mean: their sum divided by the sum of
// w[t_j] over the elements not ignored (PyTorch's weighted mean; nan when every target is ignored).
// Gradients flow to the input only: targets are indices, and a weight that requires grad is refused, as PyTorch's
// nll_loss refuses it ("not differentiable with respect to argument 'weight'").
struct NllLossOptions {
  Tensor weight{};            // [C] or undefined
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
};
Tensor nll_loss(const Tensor& input, const Tensor& target, const NllLossOptions& options = {});

// cross_entropy(x, t) = nll_loss(log_softmax(x, class dim), t) for class-index targets, with PyTorch's
// label smoothing: for eps = label_smoothing,
//   loss = (1 - eps) * nll_loss(...) + eps / C * smooth,   smooth_j = -sum_c w[c] * log_softmax(x)[j, c]
// where smooth is zero at ignored targets and reduced as nll_loss reduces (Mean: divided by the same sum
// of target weights). A floating target of the input's shape holds class probabilities instead:
//   loss_j = -sum_c w[c] * p[j, c] * log_softmax(x)[j, c],   p smoothed to (1 - eps) p + eps / C,
// Mean dividing by the number of samples N * d1 * ... * dk (nan for an empty input, as PyTorch: [N, 0] too);
// ignore_index must be left negative (an error otherwise, as PyTorch's), and the target and the weight receive a
// gradient when they require one (the class-index forms refuse such a weight, as nll_loss does).
// The class-index form without smoothing saves the logits themselves for its backward (PyTorch saves
// log_softmax's output): an in-place change of them before backward() is the usual "modified by an in-place
// operation" error.
struct CrossEntropyOptions {
  Tensor weight{};            // [C] or undefined
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // in [0, 1]
  Reduction reduction = Reduction::Mean;
};
Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& options = {});
// The gradient of cross_entropy(logits [N, C], target [N], {.ignore_index}) (a Mean) by the logits, times g (0-d), in
// ops that record, in the accumulation dtype: linear_cross_entropy's backward in a pass with create_graph.
Tensor cross_entropy_mean_gradient(const Tensor& logits, const Tensor& target, const Tensor& g, int64_t ignore_index);

// ---- binary cross-entropy
//
// On probabilities p in [0, 1] (the output of a sigmoid), targets y in [0, 1], optional weight w
// (broadcast to the input's shape):
//   loss_i = -w_i * (y_i * log(p_i) + (1 - y_i) * log(1 - p_i)),   each log clamped to >= -100 (as PyTorch)
// Differentiable in input and target; a weight that requires grad is refused, as PyTorch refuses it. Input and
// target must have the same shape. On the CPU, a p outside
// [0, 1] is an error (the usual cause: logits passed where probabilities belong).
// Refused under autocast (an Error pointing to binary_cross_entropy_with_logits): in float16, a sigmoid
// saturates to exactly 0 or 1 and the log is -inf, so autocast has no safe dtype for it. This op has no
// row in kCastRules on purpose.
struct BinaryCrossEntropyOptions {
  Tensor weight{};  // broadcastable to the input, or undefined
  Reduction reduction = Reduction::Mean;
};
Tensor binary_cross_entropy(const Tensor& input, const Tensor& target, const BinaryCrossEntropyOptions& options = {});

// On logits x (the sigmoid is folded in, numerically stable for any x), with an optional pos_weight p
// (weight of the positive term, broadcast to the input: typically a [C] tensor for C labels) and weight w:
//   loss_i = w_i * ((1 - y_i) * x_i + (1 + (p - 1) * y_i) * log(1 + exp(-x_i)))
//          = -w_i * (p * y_i * log(sigmoid(x_i)) + (1 - y_i) * log(1 - sigmoid(x_i)))
// Differentiable in input and target; a weight or pos_weight that requires grad is refused, as PyTorch refuses it.
// Autocast category: "float32".
struct BinaryCrossEntropyWithLogitsOptions {
  Tensor weight{};      // broadcastable to the input, or undefined
  Tensor pos_weight{};  // broadcastable to the input, or undefined
  Reduction reduction = Reduction::Mean;
};
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BinaryCrossEntropyWithLogitsOptions& options = {});

// ---- nll_loss kernels. input [N, C, inner] (contiguous, floating T), target [N, inner] (contiguous int64);
// loss, weights, grad_loss: [N, inner] contiguous in T's accumulation dtype A (float32 for float16/bfloat16,
// else T); weight: [C] contiguous in A, or undefined (all ones).
// Forward: loss[n, i] = -w[t] * input[n, t, i] and weights[n, i] = w[t], both 0 where t == ignore_index.
// Backward: grad_input (T) is zeroed, then grad_input[n, t, i] = -w[t] * grad_loss[n, i] where t is not ignored.
// A target outside [0, C) that is not ignore_index is an error (CPU) or a device-side assertion (CUDA).
// `op` names the public op in error messages.
using NllLossKernel = void (*)(const Tensor& loss, const Tensor& weights, const Tensor& input, const Tensor& target,
                               const Tensor& weight, int64_t ignore_index, const char* op);
using NllLossBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& target,
                                       const Tensor& weight, int64_t ignore_index);
extern KernelTable<NllLossKernel> nll_loss_kernel;
extern KernelTable<NllLossBackwardKernel> nll_loss_backward_kernel;

// cross_entropy for class-index targets without label smoothing, straight from the logits: one pass over them each
// way, in A, and no log-probabilities stored (float16 logits are widened as they are read: autocast's float32 math).
// Shapes and dtypes as nll_loss's kernels; a row's normaliser, row_max and log_sum, [N, inner] in A. As log_softmax,
// the log-probability is (x - m) - log_sum: x - m is exact, where m + log_sum would round to m's ulp (a loss of 3e-7
// beside logits near 1000 read 0).
//   forward:  m = max_c input[n, c, i], row_max[n, i] = m, log_sum[n, i] = log sum_c exp(input[n, c, i] - m);
//             loss[n, i] = w[t] (log_sum - (input[n, t, i] - m)) and weights[n, i] = w[t], both 0 where t ==
//             ignore_index (t = target[n, i]; a bad t as nll_loss's)
//   backward: grad_input[n, c, i] = grad_loss[n, i] w[t] (exp((input[n, c, i] - m) - log_sum) - [c == t]), 0 where t
//             is ignored
using CrossEntropyKernel = void (*)(const Tensor& loss, const Tensor& weights, const Tensor& row_max,
                                    const Tensor& log_sum, const Tensor& input, const Tensor& target,
                                    const Tensor& weight, int64_t ignore_index);
using CrossEntropyBackwardKernel = void (*)(const Tensor& grad_input, const Tensor& grad_loss, const Tensor& input,
                                            const Tensor& row_max, const Tensor& log_sum, const Tensor& target,
                                            const Tensor& weight, int64_t ignore_index);
extern KernelTable<CrossEntropyKernel> cross_entropy_kernel;
extern KernelTable<CrossEntropyBackwardKernel> cross_entropy_backward_kernel;

}  // namespace halfgrad
