#pragma once
// dropout: in training, each element is zeroed with probability p and the survivors are scaled by
// 1 / (1 - p), so the expected value is unchanged; in evaluation it is the identity.
//
// Seeded and reproducible: the mask comes from the global Philox generator (core/random.h). A call
// reserves ceil(numel / 4) counters; element i (row-major) keeps its value when
//   Philox::uniform(Philox::generate(seed, first_counter + i / 4).x[i % 4]) < 1 - p.
// The same seed therefore gives the same mask on the CPU and on CUDA, with any number of threads, and
// the backward pass regenerates the mask from the two saved numbers instead of storing it.
#include <cstdint>

#include "core/dispatch.h"
#include "core/random.h"
#include "core/tensor.h"

namespace halfgrad {

// Autocast category: "unchanged". Floating inputs only; p in [0, 1]. training = false, or p = 0, returns x
// itself; p = 1 gives zeros (and zero gradients).
Tensor dropout(const Tensor& x, double p, bool training = true);

// ---- kernel: out = in * keep(i) / (1 - p), with keep(i) drawn as above from `state`: a dropped element is multiplied
// by 0, not replaced by it, so a dropped inf or nan gives nan, as in PyTorch (an overflow before dropout still reaches
// the loss and the scaler's check; a gradient's too). out and in are
// contiguous, of one floating dtype and one shape; 0 < p < 1. The forward and the backward run the same
// kernel (on x, then on the incoming gradient), with the same state.
using DropoutKernel = void (*)(const Tensor& out, const Tensor& in, double p, GeneratorState state);
extern KernelTable<DropoutKernel> dropout_kernel;

}  // namespace halfgrad
