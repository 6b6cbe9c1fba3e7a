#pragma once
// linear_cross_entropy: a linear layer and the cross entropy of its logits as one op, the shape of a language
// model's decoder and loss (pytorch/examples' word_language_model: decoder(output) then criterion(..., targets)).
//
//   linear_cross_entropy(x [N, in], weight [C, in], bias [C] or {}, target [N] int64, {ignore_index})
//     = cross_entropy(linear(x, weight, bias), target, {.ignore_index}), the mean over the targets that are not
//       ignore_index (NaN when all are); differentiable in x, weight and bias.
//
// Why an op of its own: with a large vocabulary the logits dominate the step's memory traffic (WikiText-2: [700,
// 33,278] float32, 93 MB, written by the decoder, read by the softmax, written again as their gradient, read by
// three more passes). On the CPU, for float32 and float64 outside autocast, the op runs over blocks of rows whose
// logits (~4 MiB) stay in cache: per block the product, the row's log-sum-exp and softmax in place, minus the
// one-hot target, then the block's share of all three gradients; each thread takes whole blocks and keeps its own
// weight and bias gradient, added up at the end. The gradients of the summed loss are made in the forward and
// scaled by the upstream gradient in the backward: one exp per logit, where the separate ops need two.
// Elsewhere (CUDA, float16/bfloat16, under autocast: linear's "lower precision" then cross_entropy's "float32
// math", core/autocast.h) it is that composition, with the same values.
// Forward, backward and the CPU kernel: ops/linear_cross_entropy.cpp.
#include <cstdint>

#include "core/tensor.h"

namespace halfgrad {

struct LinearCrossEntropyOptions {
  int64_t ignore_index = -100;  // targets with this value count neither in the loss nor in the mean
};

Tensor linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& target,
                            const LinearCrossEntropyOptions& options = {});

}  // namespace halfgrad
