#pragma once
// Loss functions. Each takes a Reduction, as torch.nn.functional's losses do.
#include "core/tensor.h"

namespace halfgrad {

// What a loss does with its per-element values: keep them (None), average them (Mean), add them (Sum).
enum class Reduction { None, Mean, Sum };
const char* reduction_name(Reduction reduction);

// Mean squared error: (input - target)^2, reduced. input and target must have the same shape (PyTorch
// broadcasts with a warning, which hides a wrong target shape: [N] against [N, 1] gives an [N, N] loss;
// here it is an error). Differentiable in both input and target. Autocast category: "float32".
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace halfgrad
