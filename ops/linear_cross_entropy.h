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
// three more passes). The gradients of the summed loss are made in the forward, where the softmax is at hand, and
// scaled by the upstream gradient in the backward: one exp per logit, where the separate ops need two.
//   CPU, float32 and float64 outside autocast: over blocks of rows whose logits (~4 MiB) stay in cache: per block
//     the product, the row's log-sum-exp and softmax in place, minus the one-hot target, then the block's share of
//     all three gradients; each thread takes whole blocks and keeps its own weight and bias gradient, added up at
//     the end.
//   CUDA, every floating dtype and under autocast: on operands padded so that cuBLAS runs its fast kernels (every
//     extent a multiple of 16 bytes; WikiText-2's 33,278 words and 650 units are not, and the unaligned float16
//     products ran 3x slower): x_p = [x, 1, 0...] [N, in_p] and w_p = [W, b, 0...] [C_p, in_p], made by one copy
//     each that also casts to the compute dtype, so the bias rides in the product as one more column of k. The
//     logits x_p w_p^T [N, C_p] become, in place and in one pass per row, (softmax - one-hot) * kGradFactor (zeros
//     in the padded columns); the backward is two products on them, G w_p [N, in_p] and G^T x_p [C_p, in_p] (whose
//     column `in` is the bias gradient), accumulated in float32 (float64 for float64), scaled by the upstream
//     gradient / (targets counted * kGradFactor) as the products' alpha (read on the device: a scale loaded per
//     element made the weight gradient's copy out 96 µs a step where the copy in takes 46), and copied out in the
//     dtypes of x, W and b. A weight laid out as MemoryFormat::AlignedRows (core/tensor.h) in the products' dtype,
//     with a spare column for the bias (or no bias), is w_p as it is (its padding is zero; an in-place change to it
//     before the backward is an error, as for a saved tensor): the bias is then added in the row pass instead,
//     and the weight gradient, where it has the accumulation's dtype, is G^T x_p itself with its bias column
//     cleared, an aligned-rows tensor like W. That saves the copies of W in and of its gradient out: the language
//     model's decoder lays its weight out so (models/language_model.h). Nothing is synchronised with the host (a
//     CUDA graph can capture it); a bad target stops the kernel as cross_entropy's does.
//   Elsewhere (the CPU under autocast or for float16/bfloat16) it is that composition, with the same values.
// Precision on CUDA under autocast (apex O1): the products in the autocast dtype (linear's "lower precision", the
// casts of x, W and b done by the padding copies), the softmax and the loss in float32 (cross_entropy's "float32
// math"), the loss float32, the gradients of float32 x, W, b float32.
// Forward, backward and the CPU kernel: ops/linear_cross_entropy.cpp; the CUDA kernels: ops/linear_cross_entropy.cu.
#include <cstdint>

#include "core/dispatch.h"
#include "core/tensor.h"

namespace halfgrad {

struct LinearCrossEntropyOptions {
  int64_t ignore_index = -100;  // targets with this value count neither in the loss nor in the mean
};

Tensor linear_cross_entropy(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& target,
                            const LinearCrossEntropyOptions& options = {});

// ---- the padded path's kernels (CUDA: ops/linear_cross_entropy.cu)

// The padded logits' rows hold (softmax - one-hot) times this: 2^10 keeps float16's subnormal range (below 6e-5)
// for softmax values under 6e-8 rather than flushing them, and stays far from its overflow (65,504). Exact to undo.
constexpr double kGradFactor = 1024;

// dst [R, K] (dense) = src[r, c] where r and c are within src (a matrix with unit column stride), `extra_column` at
// column `extra_index` of the rows within src (its r-th element, or 1 when it is undefined; extra_index -1: none),
// zeros elsewhere; cast to dst's dtype.
using PaddedCopyKernel = void (*)(const Tensor& dst, const Tensor& src, int64_t extra_index,
                                  const Tensor& extra_column);
// logits [N, C_p] (dense, C_p * element size a multiple of 16), in place, each row's first `classes` logits taken
// plus bias (dense [classes] of the logits' dtype; undefined: none): row_loss[n] = their log-sum-exp less the
// target's and row_count[n] = 1, or both 0 where target[n] is ignore_index; with grad_factor != 0 the row becomes
// grad_factor * (softmax - one-hot) over those columns, zeros beyond (zeros throughout for an ignored row). row_loss
// and row_count: [N] in the logits' compute dtype (float32 for 16-bit).
using LceRowsKernel = void (*)(const Tensor& logits, int64_t classes, const Tensor& bias, const Tensor& target,
                               int64_t ignore_index, const Tensor& row_loss, const Tensor& row_count,
                               double grad_factor);
extern KernelTable<PaddedCopyKernel> padded_copy_kernel;
extern KernelTable<LceRowsKernel> lce_rows_kernel;

}  // namespace halfgrad
