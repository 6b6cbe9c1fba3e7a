#pragma once
// Optimizers update parameters from their .grad, without recording autograd.
#include <vector>

#include "core/tensor.h"

namespace halfgrad::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // Forgets the gradients of every parameter. Like PyTorch (set_to_none=True) the gradient becomes
  // undefined rather than zero: the next backward stores instead of adding, which saves a pass.
  void zero_grad();
  virtual TensorList parameters() const = 0;
};

}  // namespace halfgrad::optim
