#pragma once
// Our CUDA kernels for convolutions whose window holds at most 32 values (C * kH * kW <= 32): an image network's
// first layer, 3 colour channels under a 3x3 kernel. cuDNN's NHWC tensor-core engines read channels in multiples of
// 8, so for 3 it pads the input and runs general kernels. Here one output pixel's whole window is one 32-wide slice
// of the reduction, gathered into shared memory (im2col by 128-pixel tiles) and multiplied on tensor cores
// (mma.sync m16n8k16, float32 accumulation). At ResNet-18's CIFAR stem, batch 256 float16 on an H200: the weight
// gradient 33 µs against cuDNN's 67, the forward 41 against 44 (docs/benchmarks.md, session 45).
//
// They are candidates of conv2d's CUDA autotuner (ops/conv.cu), timed against cuDNN's engines like any engine; the
// tests call them directly. The data gradient of such a layer is rarely wanted (its input is the data) and stays
// with cuDNN.
#include <cstdint>

#include "core/tensor.h"
#include "ops/conv.h"

namespace halfgrad {

// Whether the kernels take the problem: float16 or bfloat16 on a GPU of compute capability 8.0 or newer, no empty
// operand, one group, C * kH * kW <= 32, O a multiple of 8, the input and output dense channels_last (x [N, C, H, W] and y [N, O, OH, OW]
// as NHWC) and y 16-byte aligned; the weight may have any strides. (x, w, y) in the forward's roles.
bool few_channels_conv_takes(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& params);

// The two kernels below throw (naming the operands) for a problem few_channels_conv_takes declines; with no output
// pixels they write nothing (forward) or zeros (weight gradient).

// y = conv2d(x, w) without bias, written.
void few_channels_conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& params);

// grad_weight = the weight's gradient, written, summed in a fixed order: per-block float32 partial sums in `workspace`
// (uint8, at least few_channels_weight_workspace bytes), then one pass adds them up. The same bits run to run on one
// GPU; another model may differ (the number of blocks follows its SM count and occupancy).
int64_t few_channels_weight_workspace(const Tensor& x, const Tensor& w, const Tensor& y);
void few_channels_conv_backward_weight(const Tensor& grad_weight, const Tensor& grad_output, const Tensor& x,
                                       const Conv2dParams& params, const Tensor& workspace);

}  // namespace halfgrad
