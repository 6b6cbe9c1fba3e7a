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
#include "core/half.h"
#include "core/random.h"
#include "core/tensor.h"

namespace halfgrad {

// Autocast category: "unchanged". Floating inputs only; p in [0, 1]. training = false, or p = 0, returns x
// itself; p = 1 gives x * 0 (zeros, nan where x is inf or nan) and the gradient times 0.
Tensor dropout(const Tensor& x, double p, bool training = true);
// x times the mask and scale that the counters `state` draw (0 < p < 1), recorded (differentiable to any order):
// dropout with counters reserved before, as the recurrent op's between its layers, which a pass with create_graph forms
// again.
Tensor dropout_masked(const Tensor& x, double p, GeneratorState state);

// What an element is multiplied by, given its uniform draw u: 1 / (1 - p) where kept, 0 where dropped. Multiplied by
// 0, not replaced by 0, so that a dropped inf or nan gives nan, as in PyTorch: an overflow before dropout still
// reaches the loss and the scaler's check, and a gradient's its own. (Both devices' kernels.)
template <typename A> HG_HOST_DEVICE inline A dropout_factor(float u, float keep, A scale) {
  return u < keep ? scale : A(0);
}

// ---- kernel: out = in * keep(i) / (1 - p), with keep(i) drawn as above from `state`. out and in are
// contiguous, of one floating dtype and one shape; 0 < p < 1. The forward and the backward run the same
// kernel (on x, then on the incoming gradient), with the same state.
using DropoutKernel = void (*)(const Tensor& out, const Tensor& in, double p, GeneratorState state);
extern KernelTable<DropoutKernel> dropout_kernel;

}  // namespace halfgrad
